"""THE posted step, the one exchange every split of a step across the processes goes through
(the FFN's neurons: sparse_ffn.SparseFfn; attention heads: attention_split.SplitAttention;
vocabulary rows: sparse_ffn.SplitHead; every layer at once: lockstep_decode.LockstepDecode):

  1. post: the request goes into shared memory and the doorbell rings the worker slots `part`;
  2. own share: the coordinator computes its part meanwhile (`own(request)`);
  3. wait: until every slot of `part` marked the step done (their active counts, the slowest's ns);
  4. sum: the caller adds the slots' shares (`sum_slots` for the usual case), since what a share
     is (FFN outputs, attention outputs, logits, nothing) is the caller's.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, TypeVar

import numpy as np

from protocol.doorbell import CoordinatorBell, Request
from protocol.shm_layout import StepKind

T = TypeVar("T")


class Posted(NamedTuple):
    own: object  # what the coordinator's own share returned
    n_active: int  # the workers' active neuron-token pairs, summed
    slowest_ns: int  # the slowest worker's compute time


def run_posted(bell: CoordinatorBell, kind: StepKind, layer: int, n_tokens: int, part: np.ndarray,
               own: Callable[[Request], T] | None = None, dense: bool = True, threshold: bool = False,
               predict: bool = False) -> Posted:
    """Post the step, compute the coordinator's share (own, given the posted request), wait for
    the workers of `part`."""
    posted = bell.post(kind, layer, n_tokens, dense, threshold, part, predict)
    mine = own(posted) if own is not None else None
    n_active, slowest_ns = bell.wait(posted.step, part)
    return Posted(mine, n_active, slowest_ns)


def sum_slots(out: np.ndarray, slots, n_tokens: int) -> np.ndarray:
    """The shares of output slots `slots` (rows [0, n_tokens)) summed in slot order, a new array."""
    if len(slots) == 1:
        return out[slots[0], :n_tokens].copy()
    if len(slots) == 2:  # one worker and the coordinator: the common CPU-only case
        return np.add(out[slots[0], :n_tokens], out[slots[1], :n_tokens])
    return out[slots, :n_tokens].sum(axis=0)
