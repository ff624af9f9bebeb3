"""Continuous batching: up to N sequences decode together, one pass over the weights per step.

The `Scheduler` owns the engine's model on one thread. Each step it
  1. admits waiting requests into free slots, reusing the KV cache of the slot whose previous
     conversation shares the longest prefix with the new prompt (multi-turn chat does not
     re-prefill its history);
  2. prefills one chunk of one admitted prompt (chunked, so running streams stall at most a
     chunk's time);
  3. decodes one token for every running sequence together (`Transformer.decode_batch`: the
     FFN and the head see all rows at once, attention runs per sequence on its own cache);
  4. samples each sequence's next token (from what its grammar allows, for structured output),
     checks EOS, stop strings (across token boundaries), a completed grammar and lengths, and
     hands the text to the request's `on_event` callback.
A cancelled request (its client went away) leaves its slot at the next step. Requests beyond
the slots wait in a bounded queue; beyond that `submit` raises `Overloaded`.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..text.structured_output import Constraint, GrammarError
from ..text.tokenizer import GGUFTokenizer, StreamDecoder
from .sampling import Sampler, SamplingParams, log_softmax
from .speculative import verify_pick

MAX_TOP_LOGPROBS = 20


class Overloaded(Exception):
    """Every slot is busy and the queue is full."""


@dataclass
class TokenEvent:
    """One generated token: `text` is what became final with it (may be empty while a stop
    string or a UTF-8 character is incomplete, or hold earlier tokens' text)."""
    token: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class DoneEvent:
    reason: str  # "stop" (EOS or a stop string), "length", "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str = ""  # text released at the end (held back until now)
    stop_string: str | None = None  # the stop string that ended the output (Anthropic's API reports it)


@dataclass
class FailedEvent:
    message: str


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    on_event: Callable[[object], None]  # called on the scheduler's thread: must not block
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_at_eos: bool = True
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    constraint: Constraint | None = None  # structured output: the grammar this sequence follows
    keep_special: bool = False  # control tokens' text stays in the output (gpt-oss's harmony channels are parsed from it)
    cancelled: threading.Event = field(default_factory=threading.Event)


class StopMatcher:
    """Finds stop strings in generated text that arrives in pieces: text that could still be
    the start of a stop string is held back until the next piece decides."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit: str | None = None  # the stop string found

    def push(self, text: str) -> tuple[str, bool]:
        """(text now final, whether a stop string ended the output)."""
        if not self.stops:
            return text, False
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            first = min(hits)
            self.hit = next(s for s in self.stops if self.buf.find(s) == first)
            out, self.buf = self.buf[:first], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Slot:
    """One sequence's place in the batch: its KV cache and the tokens whose keys it holds."""

    def __init__(self, cache):
        self.cache = cache
        self.tokens: list[int] = []  # in the cache, in order (cache.pos == len(tokens))
        self.req: Request | None = None
        self.last_used = 0.0

    def start(self, req: Request, tokenizer: GGUFTokenizer) -> None:
        # Reuse the cached prefix; at least the prompt's last token is run again for its logits.
        keep = min(common_prefix(self.tokens, req.prompt_ids), len(req.prompt_ids) - 1)
        self.tokens = self.tokens[:keep]
        self.cache.pos = keep
        self.req, self.cached = req, keep
        self.pending = list(req.prompt_ids[keep:])  # prompt tokens still to prefill
        self.next: int | None = None  # sampled, not yet run through the model
        self.generated = 0
        self.history = list(req.prompt_ids)  # what the penalties look back on
        self.sampler = Sampler(req.sampling)
        self.text = StreamDecoder(tokenizer, skip_special=not req.keep_special)
        self.stops = StopMatcher(req.stop)
        self.spec = None  # speculative decoding's state for this sequence (Scheduler._admit)

    def free(self) -> None:
        self.req = None
        self.last_used = time.perf_counter()


class Scheduler:
    def __init__(self, engine, parallel: int = 4, queue: int = 16, prefill_chunk: int = 128):
        if parallel < 1 or queue < 0 or prefill_chunk < 1:
            raise ValueError("parallel and the prefill chunk must be >= 1, the queue >= 0")
        self.engine, self.model, self.tokenizer = engine, engine.model, engine.tokenizer
        # slot 0 reuses the model's own cache: one fewer context-sized allocation
        self.slots = [Slot(self.model.cache if i == 0 else self.model.new_cache()) for i in range(parallel)]
        self.queue_size, self.prefill_chunk = queue, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.error: str | None = None  # set when the engine failed: every request fails from then on
        self.steps = 0  # decode steps run (tests watch slots leave within one)
        self._rr = 0
        self.spec = getattr(engine, "spec", None)  # speculative decoding (coordinator/runtime/speculative.py)
        # work run on this thread between steps, the model being this thread's: objects with
        # `pending`, `run()` and `fail(message)` (embeddings: coordinator/runtime/embedding.py EmbedQueue)
        self.side_work: list = []
        self.thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    @property
    def max_ctx(self) -> int:
        return self.model.max_ctx

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    def submit(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ValueError("empty prompt: nothing to condition on")
        if len(req.prompt_ids) + req.max_tokens > self.max_ctx:
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                             f"the context size {self.max_ctx}")
        req.sampling.validate()
        with self.cv:
            if self.error is not None:
                raise RuntimeError(self.error)
            if self.stopping:
                raise Overloaded("the server is shutting down")
            busy = sum(s.req is not None for s in self.slots)
            if busy == len(self.slots) and len(self.waiting) >= self.queue_size:
                raise Overloaded(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests wait")
            self.waiting.append(req)
            self.cv.notify()

    def check_room(self) -> None:
        """Raise Overloaded now if submit would: a request refused anyway need not be prepared
        (a chat template rendered) first."""
        with self.cv:
            busy = sum(s.req is not None for s in self.slots)
            if busy == len(self.slots) and len(self.waiting) >= self.queue_size:
                raise Overloaded(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests wait")

    def busy_slots(self) -> int:
        return sum(s.req is not None for s in self.slots)

    # ---- the scheduler's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except Exception as e:  # a worker died, or a bug: fail every request, report the error
            msg = f"{type(e).__name__}: {e}" if not str(e) else str(e)
            with self.cv:
                self.error = msg
                failed = [s.req for s in self.slots if s.req is not None] + list(self.waiting)
                self.waiting.clear()
            for w in self.side_work:
                w.fail(msg)
            for s in self.slots:
                s.req = None
            for r in failed:
                r.on_event(FailedEvent(msg))

    def _step(self) -> bool:
        with self.cv:
            while (not self.stopping and not self.waiting and all(s.req is None for s in self.slots)
                   and not any(w.pending for w in self.side_work)):
                if not self.cv.wait(0.5):
                    self.engine.check_workers()  # a worker dying while idle is reported promptly
            if self.stopping:
                for r in self.waiting:
                    r.on_event(FailedEvent("the server is shutting down"))
                self.waiting.clear()
                for s in self.slots:
                    if s.req is not None:
                        s.req.on_event(FailedEvent("the server is shutting down"))
                        s.req = None
                for w in self.side_work:
                    w.fail("the server is shutting down")
                return False
            self._admit()
        for w in self.side_work:
            if w.pending:
                w.run()
        for s in self.slots:
            if s.req is not None and s.req.cancelled.is_set():
                self._finish(s, "cancelled")
        self._prefill_one()
        self._decode()
        return True

    def _admit(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            if req.cancelled.is_set():
                self.waiting.popleft()
                continue
            free = [s for s in self.slots if s.req is None]
            if not free:
                return
            # longest shared prefix first, then the least recently used
            slot = max(free, key=lambda s: (common_prefix(s.tokens, req.prompt_ids), -s.last_used))
            self.waiting.popleft()
            try:
                slot.start(req, self.tokenizer)
                if self.spec is not None:
                    slot.spec = self.spec.new_sequence()
            except Exception as e:  # this request's settings, not the engine: fail it alone
                slot.free()
                req.on_event(FailedEvent(f"{type(e).__name__}: {e}"))

    def _prefill_one(self) -> None:
        filling = [s for s in self.slots if s.req is not None and s.pending]
        if not filling:
            return
        s = filling[self._rr % len(filling)]
        self._rr += 1
        chunk, s.pending = s.pending[: self.prefill_chunk], s.pending[self.prefill_chunk:]
        logits = self.model.forward(chunk, cache=s.cache)
        s.tokens += chunk
        if not s.pending:
            self._take(s, logits[-1])

    def _decode(self) -> None:
        running = [s for s in self.slots if s.req is not None and s.next is not None]
        if not running:
            return
        spec, drafts = self.spec, [[] for _ in running]
        if spec is not None:  # a sequence may take drafted tokens as rows of its own this step
            room = [min(s.req.max_tokens - s.generated, self.max_ctx - s.cache.pos) - 1 for s in running]
            drafts = spec.plan([s.spec for s in running], [s.history for s in running], room,
                               [s.sampler for s in running])
        t0 = time.perf_counter()
        if any(drafts):
            logits = self.model.decode_runs([([s.next, *d], s.cache) for s, d in zip(running, drafts)])
        else:
            logits = self.model.decode_batch([s.next for s in running], [s.cache for s in running])
        if spec is not None:
            spec.cost.add(len(logits), time.perf_counter() - t0)
        self.steps += 1
        if self.steps % 1000 == 0:
            self.engine.ffn.stats.trim()  # bounded memory however long the server runs
        at = 0
        for s, d in zip(running, drafts):
            self._verify(s, d, logits[at:at + len(d) + 1])
            at += len(d) + 1

    def _verify(self, s: Slot, draft: list[int], rows: np.ndarray) -> None:
        """Take slot s's tokens from its rows of the step: its next token's row, then one per
        drafted token while the drafts are kept; the cache drops the rows after the first
        rejected draft (its position moves back)."""
        p0 = s.cache.pos - len(rows)
        inputs = [s.next, *draft]
        qs = s.spec.qs if s.spec is not None and s.spec.qs else [None] * len(draft)
        for j, row in enumerate(rows):
            s.tokens.append(inputs[j])
            s.next = None
            d = draft[j] if j < len(draft) else None
            ok = self._take(s, row, d, qs[j] if d is not None else None)
            if not ok or s.req is None:
                break
        s.cache.pos = p0 + j + 1
        if self.spec is not None:
            self.spec.checked(s.spec, len(draft), j + 1 if ok else j, j + 1)

    def _take(self, s: Slot, logits: np.ndarray, draft: int | None = None, q=None) -> bool:
        """Sample the next token of slot s from its logits and pass it on, or end the sequence.
        `draft`: the drafted token this row checks (q: its draft distribution, None: a point
        mass); returns whether the token taken is it."""
        req = s.req
        try:
            pick, ok = verify_pick(logits, draft, q, s.sampler, s.history, self.tokenizer.eos_ids, req.stop_at_eos,
                                   req.constraint)
        except GrammarError as e:  # this request's grammar, not the engine: end it alone
            s.free()
            req.on_event(FailedEvent(f"structured output: {e}"))
            return False
        if pick.end == "eos":
            self._finish(s, "stop")
            return ok
        tok = pick.token
        s.generated += 1
        logprob = top = None
        if req.logprobs is not None:  # of what was sampled from: with a grammar, what it allowed
            lp = log_softmax(pick.logits)
            logprob = float(lp[tok])
            k = min(req.logprobs, MAX_TOP_LOGPROBS, len(lp))
            if k:
                best = np.argpartition(-lp, k - 1)[:k]
                best = best[np.argsort(-lp[best], kind="stable")]
                top = [(int(i), float(lp[i])) for i in best if np.isfinite(lp[i])]  # not a token the grammar forbids
        text, stopped = s.stops.push(s.text.push(tok))
        req.on_event(TokenEvent(tok, text, logprob, top))
        if stopped:
            self._finish(s, "stop", flush=False)
        elif pick.end == "grammar":  # nothing but the end can follow
            self._finish(s, "stop")
        elif s.generated >= req.max_tokens or len(s.tokens) >= self.max_ctx:
            self._finish(s, "length")
        else:
            s.next = tok
        return ok

    def _finish(self, s: Slot, reason: str, flush: bool = True) -> None:
        req = s.req
        tail = ""
        if flush and reason != "cancelled":
            tail, stopped = s.stops.push(s.text.flush())
            tail += "" if stopped else s.stops.flush()
        s.free()
        req.on_event(DoneEvent(reason, len(req.prompt_ids), s.generated, s.cached, tail, s.stops.hit))
