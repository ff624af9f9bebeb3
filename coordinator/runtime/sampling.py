"""Next-token choice from logits: penalties, then greedy or temperature with top-k, top-p and
min-p, seeded; the log-probabilities the HTTP API reports; and THE token step that `Engine.
generate` and the server's scheduler share (`pick_next`: a grammar's restriction, sampling,
whether the sequence ends with the token)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
from gguf import GGUFValueType

if TYPE_CHECKING:
    from ..text.structured_output import Constraint


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 = off
    # Penalties, as llama.cpp applies them, over the last `repeat_last_n` tokens of the sequence
    # (prompt included): repeat divides a positive logit (multiplies a negative one); presence
    # subtracts once per token seen, frequency once per occurrence (OpenAI's definitions).
    repeat_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64

    def validate(self) -> None:
        if not self.temperature >= 0:  # also NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min-p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repeat_penalty <= 10.0:
            raise ValueError(f"repeat penalty must be in (0, 10], got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name.replace('_', ' ')} must be in [-2, 2], got {v}")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat-last-n must be >= 0, got {self.repeat_last_n}")

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)


# A conversation's sampling where the model recommends none: llama.cpp's defaults
CHAT_DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
# GGUF keys of a model's recommended sampling (gguf.Keys.General.SAMPLING_*) -> SamplingParams fields
_RECOMMENDED = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                "general.sampling.penalty_repeat": "repeat_penalty", "general.sampling.penalty_last_n": "repeat_last_n"}


_NOT_NUMBERS = (GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.BOOL)


def chat_defaults(reader) -> dict:
    """CHAT_DEFAULTS with what the GGUF's general.sampling.* keys recommend over them (values of
    the wrong kind ignored: the file is not trusted)."""
    out = dict(CHAT_DEFAULTS)
    for key, name in _RECOMMENDED.items():
        field = reader.fields.get(key)
        if field is None or not field.data or not field.types or field.types[0] in _NOT_NUMBERS:
            continue
        try:
            v = field.parts[field.data[0]][0].item()
        except (IndexError, AttributeError, ValueError):
            continue
        kind = int if name in ("top_k", "repeat_last_n") else float
        if isinstance(v, (int, float)) and np.isfinite(v):
            out[name] = kind(v)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits after the repeat, presence and frequency penalties over the recent history."""
        p = self.p
        if not p.penalized or not history:
            return logits
        counts = Counter(history[-p.repeat_last_n:])
        ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
        ids = ids[(ids >= 0) & (ids < len(logits))]
        n = np.array([counts[int(i)] for i in ids], dtype=np.float32)
        out = logits.astype(np.float32, copy=True)
        v = out[ids]
        v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        out[ids] = v - n * p.frequency_penalty - p.presence_penalty
        return out

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution actually sampled from, after temperature, top-k, top-p and min-p."""
        z = logits.astype(np.float64) / self.p.temperature
        if 0 < self.p.top_k < len(z):
            kth = np.partition(z, -self.p.top_k)[-self.p.top_k]
            z = np.where(z >= kth, z, -np.inf)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if self.p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, self.p.top_p)) + 1]  # smallest set reaching top_p
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        if self.p.min_p > 0.0:
            probs = np.where(probs >= self.p.min_p * probs.max(), probs, 0.0)
            probs /= probs.sum()
        return probs

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        logits = self.penalize(logits, history)
        if self.p.temperature == 0.0:
            return int(np.argmax(logits))
        probs = self.probabilities(logits)
        return int(self.rng.choice(len(probs), p=probs))


@dataclass
class Pick:
    token: int
    logits: np.ndarray  # what it was sampled from: the model's, or what a grammar left of them
    end: str | None  # "eos": an end-of-sequence token (no text); "grammar": complete with this token; None: goes on


def pick_next(logits: np.ndarray, sampler: Sampler, history: list[int], eos_ids, stop_at_eos: bool = True,
              grammar: "Constraint | None" = None) -> Pick:
    """One sequence's next token: the tokens `grammar` forbids set to -inf, sampled (penalties
    over `history`, which gains the token), and whether the sequence ends with it. A grammar's
    end-of-sequence token ends it even with stop_at_eos off (the grammar allowed it: complete).
    Raises structured_output.GrammarError when the grammar cannot go on (that request's failure)."""
    if grammar is not None:
        logits = grammar.restrict(logits)
    tok = sampler(logits, history)
    history.append(tok)
    if tok in eos_ids and (stop_at_eos or grammar is not None):
        return Pick(tok, logits, "eos")
    if grammar is not None:
        grammar.accept(tok)
        if grammar.complete:
            return Pick(tok, logits, "grammar")
    return Pick(tok, logits, None)
