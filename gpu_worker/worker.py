"""The GPU worker: the CPU worker's logic (cpu_worker/worker.py) holding the hot neurons on a
CUDA device when there is one. It differs only in the device it picks."""
from __future__ import annotations

import torch


def pick_device(requested: str) -> torch.device:
    if requested not in ("auto", ""):
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
