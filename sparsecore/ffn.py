"""The FFN math every worker runs, for whichever neurons it owns and whichever are active.

A worker holds, per layer, the gate and up rows of its neurons and the matching down
columns stored as rows (down_t), so that both dense and sparse steps are row gathers:
    y = down_t[A]^T @ (act(gate[A] @ x) * (up[A] @ x))
Summing y over workers gives the full FFN with inactive neurons zeroed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "relu": F.relu}


def ffn_partial(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor,
                activation: str, active: torch.Tensor | None = None) -> torch.Tensor:
    """x: (T, hidden); gate/up/down_t: (n_owned, hidden); active: local row indices or None (all)."""
    if active is not None:
        if active.numel() == 0:
            return x.new_zeros(x.shape)
        gate, up, down_t = gate.index_select(0, active), up.index_select(0, active), down_t.index_select(0, active)
    h = ACTIVATIONS[activation](x @ gate.T) * (x @ up.T)
    return h @ down_t


def ffn_dense_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        activation: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dense FFN (down: hidden x n_ff) with inactive neurons zeroed: the oracle for sparse steps."""
    h = ACTIVATIONS[activation](x @ gate.T) * (x @ up.T)
    if mask is not None:
        h = h * mask.to(h.dtype)
    return h @ down.T


def ffn_partial_threshold(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor,
                          activation: str, threshold: float) -> tuple[torch.Tensor, int]:
    """CATS: a neuron is active for a token where |act(gate x)| > threshold; up and down are
    computed for active neurons only. Returns (output, active neuron-token pairs).
    One token: gather the active rows. Several: the same math with a mask (prefill-sized
    batches activate nearly every neuron somewhere, so gathering would not pay)."""
    g = ACTIVATIONS[activation](x @ gate.T)
    keep = g.abs() > threshold
    if x.shape[0] == 1:
        active = keep[0].nonzero().squeeze(1)
        if active.numel() == 0:
            return x.new_zeros(x.shape), 0
        h = g[:, active] * (x @ up.index_select(0, active).T)
        return h @ down_t.index_select(0, active), int(active.numel())
    h = g * (x @ up.T) * keep
    return h @ down_t, int(keep.sum())
