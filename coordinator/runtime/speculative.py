"""Speculative decoding: cheap guesses of the next tokens (a draft), checked by the model in one
step of its batch kernels (Transformer.decode_runs: the sequence's next token and the k drafted
ones as k + 1 rows), keeping the drafted tokens the model agrees with and the model's own token
after them. A decode step's weights are read once for all its rows, so a step of several rows
costs little more than one while the memory bandwidth bounds it.

Drafts: `NgramIndex` (prompt lookup: the tokens that followed the latest earlier occurrence of
the sequence's last few tokens; no extra model, and text that repeats its prompt, a rewrite or
code, is mostly drafted right) or `DraftModel` (a smaller model of the same vocabulary with
KV caches of its own).

Exactness. Greedy: each row's token is picked from its logits exactly as plain decoding picks
(pick_next), and every row's logits are the ones plain decoding computes (decode_runs' rows
are decoded tokens' arithmetic), so the text is plain decoding's. Sampling: a drafted token d
is kept with probability min(1, p(d) / q(d)) (p: the distribution plain decoding samples from,
after penalties, temperature, top-k/p, min-p and a grammar; q: the draft's), else the token is
drawn from max(0, p - q) renormalized; that makes every token distributed as p (Leviathan et
al. 2023). An n-gram draft is a point mass: q(d) = 1.

When it pays (`Speculator.plan`): per sequence an estimate of the chance the next drafted
token is kept (alpha, counted over the sequence's checks, starting from the engine's), and per
number of rows in a step its measured time; a step takes the draft rows that maximize expected
tokens per second, none when one row is best. A sequence whose drafts stopped paying is probed
again after a gap that doubles with each failed probe: free-form text drafts little and wrongly,
and then speculation costs almost nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np

from sparsecore.kernels import MAX_SMALL_BATCH

from .sampling import Pick, Sampler, pick_next

if TYPE_CHECKING:
    from ..text.structured_output import Constraint

SPEC_MODES = ("off", "ngram", "draft")
MAX_DRAFT = 12  # drafted tokens a sequence proposes per step (rows: one more)
NGRAM_SIZES = (4, 3, 2)  # suffix lengths looked up, longest first (1 token matches too much by chance)


@dataclass
class SpecStats:
    """Counts over sequences: `steps` target steps a sequence took part in, `tokens` the tokens
    they gave, `drafted` drafted tokens checked, `accepted` those kept."""
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def line(self) -> str:
        """The stats line's part (coordinator/cli/reports.py)."""
        return (f"spec: {self.tokens_per_step:.2f} tok/step, acceptance {100 * self.acceptance:.0f} % "
                f"({self.accepted}/{self.drafted})")


class NgramIndex:
    """Prompt lookup over one sequence's tokens (prompt and generated, which only grow): for each
    n in NGRAM_SIZES, where the token after each n-gram's latest occurrence is."""

    def __init__(self):
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.matched = 0  # the suffix length the last proposal matched (0: none)

    def extend(self, tokens: list[int]) -> None:
        """`tokens`: the sequence so far (what was indexed is a prefix of it)."""
        old = len(self.tokens)
        self.tokens.extend(tokens[old:])
        t = self.tokens
        for i in range(max(old, 1), len(t)):  # n-grams ending at i - 1, followed by t[i]
            for n in NGRAM_SIZES:
                if i >= n:
                    self.after[tuple(t[i - n:i])] = i

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix seen before (none: no match)."""
        t = self.tokens
        for n in NGRAM_SIZES:
            j = self.after.get(tuple(t[-n:])) if len(t) > n else None
            if j is not None:
                self.matched = n
                return t[j:j + k]
        self.matched = 0
        return []


class DraftModel:
    """A smaller model of the same vocabulary (its own Engine, workers and KV caches) that drafts
    by decoding ahead; `propose` re-syncs a sequence's draft cache to its tokens first."""

    def __init__(self, engine, target_tokenizer):
        if list(engine.tokenizer.tokens) != list(target_tokenizer.tokens):
            raise ValueError(f"draft model {engine.path.name}: its vocabulary is not the model's "
                             f"({len(engine.tokenizer.tokens)} against {len(target_tokenizer.tokens)} tokens)")
        self.engine, self.model = engine, engine.model

    def new_state(self) -> "DraftState":
        return DraftState(self.model.new_cache())

    def propose(self, st: "DraftState", tokens: list[int], k: int, sampler: Sampler) -> tuple[list[int], list]:
        """Up to k tokens after `tokens`, and each one's distribution (None where greedy)."""
        if k <= 0:
            return [], []
        from .batching import common_prefix

        keep = min(common_prefix(st.tokens, tokens), len(tokens) - 1)  # the last token runs for its logits
        k = min(k, self.model.max_ctx - len(tokens))
        if k <= 0:
            return [], []
        st.cache.pos, st.tokens = keep, tokens[:keep]
        logits = self.model.forward(tokens[keep:], cache=st.cache)[-1]
        st.tokens = list(tokens)
        history = list(tokens)
        out, qs = [], []
        for i in range(k):
            z = sampler.penalize(logits, history)
            if sampler.p.temperature == 0.0:
                tok, q = int(np.argmax(z)), None
            else:
                q = sampler.probabilities(z)
                tok = int(sampler.rng.choice(len(q), p=q))
            out.append(tok)
            qs.append(q)
            history.append(tok)
            if i < k - 1:
                logits = self.model.forward([tok], cache=st.cache)[-1]
                st.tokens.append(tok)
        return out, qs

    def close(self) -> None:
        self.engine.close()


@dataclass
class DraftState:
    cache: object
    tokens: list[int] = field(default_factory=list)


class SeqSpec:
    """One sequence's speculation: its n-gram index or draft cache, its acceptance counts (which
    fade, so a sequence that changes kind of text is re-estimated) and its probe gap."""

    def __init__(self, spec: "Speculator"):
        self.index = NgramIndex() if spec.draft is None else None
        self.draft_state = spec.draft.new_state() if spec.draft is not None else None
        # counts by the draft's kind: an n-gram draft's match length (a 4-token match is right
        # far more often than a 2-token one), 0 for a draft model's
        self.kept: dict[int, float] = {}
        self.missed: dict[int, float] = {}
        self.kind = 0
        self.gap, self.idle = 0, 0
        self.qs: list = []

    def alpha(self, prior: float) -> float:
        """The chance the next drafted token is kept, for drafts of the current kind."""
        w = 2.0  # the prior counts as two checked tokens
        kept, missed = self.kept.get(self.kind, 0.0), self.missed.get(self.kind, 0.0)
        return (kept + w * prior) / (kept + missed + w)


class Verifier:
    """A Sampler for pick_next that checks a drafted token (rejection sampling, module doc):
    `accepted` says whether the token it returned is the draft."""

    def __init__(self, sampler: Sampler, draft: int | None, q: np.ndarray | None):
        self.sampler, self.draft, self.q = sampler, draft, q
        self.accepted = False

    def __call__(self, logits: np.ndarray, history) -> int:
        s, d = self.sampler, self.draft
        if d is None or s.p.temperature == 0.0:
            tok = s(logits, history)
        else:
            p = s.probabilities(s.penalize(logits, history))
            qd = 1.0 if self.q is None else float(self.q[d])
            if qd > 0.0 and s.rng.random() * qd < p[d]:
                tok = d
            else:
                rest = p.copy()
                if self.q is None:
                    rest[d] = 0.0
                else:
                    rest = np.maximum(p - self.q, 0.0)
                total = rest.sum()
                tok = int(s.rng.choice(len(p), p=rest / total if total > 0 else p))
        self.accepted = d is not None and tok == d
        return tok


def verify_pick(logits: np.ndarray, draft: int | None, q, sampler: Sampler, history: list[int], eos_ids,
                stop_at_eos: bool, grammar: "Constraint | None") -> tuple[Pick, bool]:
    """pick_next for a row of a verified step: (the pick, whether it is the drafted token)."""
    v = Verifier(sampler, draft, q)
    pick = pick_next(logits, v, history, eos_ids, stop_at_eos, grammar)
    return pick, v.accepted


class StepCost:
    """Seconds of a target step by its rows (a moving average of the steps measured; before any,
    a prior of a row adding a tenth of a one-row step)."""

    def __init__(self, max_rows: int):
        self.t = np.zeros(max_rows + 1)
        self.seen = np.zeros(max_rows + 1, bool)

    def add(self, rows: int, seconds: float) -> None:
        if 0 < rows < len(self.t):
            self.t[rows] = seconds if not self.seen[rows] else 0.8 * self.t[rows] + 0.2 * seconds
            self.seen[rows] = True

    def __call__(self, rows: int) -> float:
        if self.seen[rows]:
            return float(self.t[rows])
        base = self.t[1] if self.seen[1] else 1.0
        return base * (1.0 + 0.1 * (rows - 1))


class Speculator:
    """Speculation for an engine: the drafter, the step costs, the counts (`stats`)."""

    def __init__(self, mode: str = "ngram", draft: DraftModel | None = None, max_draft: int = MAX_DRAFT,
                 max_rows: int = MAX_SMALL_BATCH):
        if mode not in SPEC_MODES or mode == "off":
            raise ValueError(f"speculation {mode!r}: choose one of ngram, draft")
        if (mode == "draft") != (draft is not None):
            raise ValueError("speculation 'draft' needs a draft model (--draft-model FILE), and only it")
        self.mode, self.draft, self.max_draft, self.max_rows = mode, draft, max_draft, max_rows
        self.cost = StepCost(max_rows)
        self.stats = SpecStats()
        self.prior: dict[int, float] = {}  # the engine's acceptance so far by draft kind, a new sequence's start
        # False: every draft is checked whole, whatever it costs (tests that must see drafts)
        self.adaptive = True

    def new_sequence(self) -> SeqSpec:
        return SeqSpec(self)

    def plan(self, seqs: list[SeqSpec | None], tokens: list[list[int]], room: list[int],
             samplers: list[Sampler]) -> list[list[int]]:
        """Each sequence's draft for the next step (seqs[b] None: it takes one row). tokens[b]:
        the sequence so far, its next token included; room[b]: drafted tokens it may still take
        (its length and context limits)."""
        B = len(seqs)
        drafts: list[list[int]] = [[] for _ in range(B)]
        spare = self.max_rows - B
        if spare <= 0:
            return drafts
        gains, probes = [], 0  # (expected tokens the j-th drafted token adds, sequence)
        for b, (s, toks, r) in enumerate(zip(seqs, tokens, room)):
            if s is None or r <= 0:
                continue
            k = min(self.max_draft, r, spare)
            if s.index is not None:
                s.index.extend(toks)
                d, s.qs = s.index.propose(k), []
                s.kind = s.index.matched
            else:  # a draft model's tokens cost a step each: none beyond where they stop paying
                a = s.alpha(self.prior.get(0, 0.6))
                if self.adaptive and a < 1.0:
                    k = min(k, max(1, int(np.log(0.2) / np.log(max(a, 1e-3))) + 1))
                d, s.qs = self.draft.propose(s.draft_state, toks, k, samplers[b])
            if not d:
                continue
            a = s.alpha(self.prior.get(s.kind, 0.6))
            drafts[b] = d
            if s.idle >= s.gap and s.gap > 0:  # a probe: one drafted token, whatever it costs
                gains.append((2.0, b))
                probes += 1
                continue
            gains += [(a ** (j + 1), b) for j in range(len(d))]
        gains.sort(key=lambda g: -g[0])
        # the number of draft rows m that maximizes expected tokens per second
        if not self.adaptive:
            gains = [(2.0, b) for _, b in gains]
        best_m, best, total = 0, B / self.cost(B), float(B)
        for m, (g, _) in enumerate(gains[:spare], 1):
            total += min(g, 1.0)
            rate = total / self.cost(B + m)
            if rate > best * 1.02:
                best_m, best = m, rate
        take = [0] * B
        for _, b in gains[:max(best_m, probes) if self.adaptive else spare]:
            take[b] += 1
        for b, s in enumerate(seqs):
            if s is None or not drafts[b]:
                continue
            if take[b] == 0:
                s.idle += 1
                if s.gap == 0:
                    s.gap = 4
            drafts[b] = drafts[b][:take[b]]
            s.qs = s.qs[:take[b]]
        return drafts

    def checked(self, s: SeqSpec | None, drafted: int, accepted: int, tokens: int) -> None:
        """A step's outcome for one sequence: drafted tokens checked, kept, tokens it gave."""
        st = self.stats
        st.steps += 1
        st.tokens += tokens
        if s is None or drafted == 0:
            return
        st.drafted += drafted
        st.accepted += accepted
        missed = 1 if accepted < drafted else 0
        k = s.kind
        s.kept[k] = 0.9 * s.kept.get(k, 0.0) + accepted
        s.missed[k] = 0.9 * s.missed.get(k, 0.0) + missed
        self.prior[k] = 0.95 * self.prior.get(k, 0.6) + 0.05 * (accepted / (accepted + missed))
        if s.idle >= s.gap and s.gap > 0:  # that was a probe
            s.gap = 4 if accepted else min(2 * s.gap, 64)
        s.idle = 0

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()


def generate(model, spec: Speculator, first_logits: np.ndarray, prompt_ids: list[int], max_tokens: int,
             sampler: Sampler, eos, stop_at_eos: bool, constraint, run_stats) -> Iterator[int]:
    """Engine.generate's token loop with speculation: the tokens after the prompt, whose logits
    (its last row) the model computed. The model's own cache holds the sequence."""
    cache = model.cache
    history = list(prompt_ids)  # what the penalties look back on, and the drafts' text
    seq = spec.new_sequence()
    pick = pick_next(first_logits, sampler, history, eos, stop_at_eos, constraint)
    produced = 1
    yield pick.token
    if pick.end is not None or produced == max_tokens:
        return
    nxt = pick.token
    while True:
        room = min(max_tokens - produced - 1, model.max_ctx - cache.pos - 1)
        draft = spec.plan([seq], [history], [room], [sampler])[0]
        qs = seq.qs if seq.qs else [None] * len(draft)
        t0 = time.perf_counter()
        rows = model.decode_runs([([nxt, *draft], cache)])
        dt = time.perf_counter() - t0
        spec.cost.add(len(draft) + 1, dt)
        run_stats.decode_s += dt
        p0 = cache.pos - len(draft) - 1
        for j in range(len(draft) + 1):
            d = draft[j] if j < len(draft) else None
            pick, ok = verify_pick(rows[j], d, qs[j] if d is not None else None, sampler, history, eos,
                                   stop_at_eos, constraint)
            produced += 1
            run_stats.decode_tokens += 1
            yield pick.token
            if pick.end is not None or produced == max_tokens or not ok:
                break
        spec.checked(seq, len(draft), j + 1 if ok else j, j + 1)
        cache.pos = p0 + j + 1  # the rows after the first rejected draft are dropped
        if pick.end is not None or produced == max_tokens:
            return
        nxt = pick.token
