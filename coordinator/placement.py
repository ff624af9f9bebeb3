"""Which worker owns which FFN neurons of each layer.

For now a static share: the GPU worker takes `gpu_share` of every layer's neurons, the CPU
workers split the rest evenly. The sparse issue replaces this with a plan from activation
profiles under a VRAM budget; the Plan shape (per worker, per layer, index arrays) stays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class WorkerShard:
    role: str  # "gpu" or "cpu"
    worker_id: int
    neurons: list[np.ndarray]  # per layer, sorted int32 neuron indices


@dataclass
class Plan:
    n_layers: int
    n_ff: int
    shards: list[WorkerShard]

    def check_partition(self) -> None:
        """Every neuron of every layer is owned by exactly one worker."""
        for layer in range(self.n_layers):
            owned = np.concatenate([s.neurons[layer] for s in self.shards])
            if len(owned) != self.n_ff or not np.array_equal(np.sort(owned), np.arange(self.n_ff)):
                raise AssertionError(f"layer {layer}: neurons are not partitioned across workers")


def static_plan(n_layers: int, n_ff: int, gpu_share: float, n_cpu_workers: int) -> Plan:
    if not 0.0 <= gpu_share <= 1.0:
        raise ValueError(f"gpu share must be within [0, 1], got {gpu_share}")
    if n_cpu_workers < 0 or (n_cpu_workers == 0 and gpu_share < 1.0):
        raise ValueError("at least one CPU worker is needed unless the GPU holds every neuron")
    n_gpu = int(round(gpu_share * n_ff))
    cuts = np.linspace(n_gpu, n_ff, n_cpu_workers + 1).round().astype(int) if n_cpu_workers else [n_ff]
    all_idx = np.arange(n_ff, dtype=np.int32)
    shards = [WorkerShard("gpu", 0, [all_idx[:n_gpu]] * n_layers)]
    for i in range(n_cpu_workers):
        shards.append(WorkerShard("cpu", i + 1, [all_idx[cuts[i]:cuts[i + 1]]] * n_layers))
    plan = Plan(n_layers, n_ff, shards)
    plan.check_partition()
    return plan
