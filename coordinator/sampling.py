"""Next-token choice from logits: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution actually sampled from, after temperature, top-k and top-p."""
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
        return probs

    def __call__(self, logits: np.ndarray) -> int:
        if self.p.temperature == 0.0:
            return int(np.argmax(logits))
        probs = self.probabilities(logits)
        return int(self.rng.choice(len(probs), p=probs))
