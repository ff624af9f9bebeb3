"""The dense FFN with inactive neurons zeroed, written out plainly: the oracle for sparse steps.
It shares nothing with sparsecore/ffn.py (not even the activation table)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ACT = {"silu": F.silu, "relu": F.relu}


def ffn_dense_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        activation: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, hidden), gate/up (n_ff, hidden), down (hidden, n_ff); mask (n_ff,) of 0/1."""
    h = _ACT[activation](x @ gate.T) * (x @ up.T)
    if mask is not None:
        h = h * mask.to(h.dtype)
    return h @ down.T
