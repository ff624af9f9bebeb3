"""coordinator.runtime.placement.static_plan: every neuron of every layer owned exactly once, GPU share
respected, CPU shards balanced, bad arguments refused."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.runtime.placement import Plan, WorkerShard, split_vocabulary, static_plan

COMBOS = [  # (n_layers, n_ff, gpu_share, n_cpu_workers)
    (2, 160, 0.4, 2),
    (1, 160, 0.0, 1),
    (3, 160, 1.0, 0),
    (3, 160, 1.0, 2),   # GPU holds everything, CPU workers get empty shards
    (2, 1536, 0.25, 3),
    (4, 7, 0.5, 3),     # tiny, uneven
    (2, 10, 0.33, 4),
    (1, 1, 0.5, 1),
    (2, 5, 0.1, 8),     # more CPU workers than cold neurons
    (30, 8192, 0.617, 5),
]


@pytest.mark.parametrize("n_layers,n_ff,gpu_share,n_cpu", COMBOS, ids=str)
def test_static_plan_partitions(n_layers, n_ff, gpu_share, n_cpu):
    plan = static_plan(n_layers, n_ff, gpu_share, n_cpu)
    assert (plan.n_layers, plan.n_ff) == (n_layers, n_ff)
    assert len(plan.shards) == 1 + n_cpu
    assert [s.role for s in plan.shards] == ["gpu"] + ["cpu"] * n_cpu
    ids = [s.worker_id for s in plan.shards]
    assert len(set(ids)) == len(ids), "worker ids must be unique (they name the ZMQ identity)"
    for s in plan.shards:
        assert len(s.neurons) == n_layers
    n_gpu = round(gpu_share * n_ff)
    for layer in range(n_layers):
        owned = [np.asarray(s.neurons[layer]) for s in plan.shards]
        for o in owned:
            assert o.dtype == np.int32
            assert np.all(np.diff(o) > 0), "indices sorted, no duplicates"
        counts = np.bincount(np.concatenate(owned).astype(np.int64), minlength=n_ff)
        assert counts.shape == (n_ff,)
        assert np.all(counts == 1), f"layer {layer}: some neuron owned {counts.min()}..{counts.max()} times"
        # GPU share, rounded to a whole neuron.
        assert len(owned[0]) == n_gpu
        assert abs(len(owned[0]) - gpu_share * n_ff) <= 0.5
        # CPU shards split the rest evenly (within one neuron).
        if n_cpu:
            sizes = [len(o) for o in owned[1:]]
            assert sum(sizes) == n_ff - n_gpu
            assert max(sizes) - min(sizes) <= 1
    plan.check_partition()


def test_check_partition_catches_bad_plans():
    idx = np.arange(10, dtype=np.int32)
    missing = Plan(1, 10, [WorkerShard("gpu", 0, [idx[:4]]), WorkerShard("cpu", 1, [idx[5:]])])
    with pytest.raises(AssertionError, match="layer 0"):
        missing.check_partition()
    doubled = Plan(1, 10, [WorkerShard("gpu", 0, [idx[:6]]), WorkerShard("cpu", 1, [idx[4:]])])
    with pytest.raises(AssertionError, match="layer 0"):
        doubled.check_partition()
    ok_then_bad = Plan(2, 10, [WorkerShard("gpu", 0, [idx[:5], idx[:5]]),
                               WorkerShard("cpu", 1, [idx[5:], idx[6:]])])
    with pytest.raises(AssertionError, match="layer 1"):
        ok_then_bad.check_partition()


@pytest.mark.parametrize("args", [
    (2, 160, -0.1, 2),
    (2, 160, 1.01, 2),
    (2, 160, float("nan"), 2),
    (2, 160, 0.5, 0),    # cold neurons but no CPU worker
    (2, 160, 0.0, 0),
    (2, 160, 0.5, -1),
], ids=str)
def test_static_plan_invalid(args):
    with pytest.raises(ValueError):
        static_plan(*args)


@pytest.mark.parametrize("n_ff,gpu_share,n_cpu,coord", [
    (1536, 0.0, 1, 0.5), (1536, 0.0, 3, 0.25), (160, 0.4, 2, 1 / 3), (7, 0.0, 1, 0.5), (160, 0.0, 1, 0.001)])
def test_static_plan_coordinator_share(n_ff, gpu_share, n_cpu, coord):
    """The coordinator's shard is the last one and takes its fraction of the non-GPU neurons;
    GPU and CPU shards split the rest as before, every neuron still owned exactly once."""
    plan = static_plan(2, n_ff, gpu_share, n_cpu, coord)
    n_gpu = round(gpu_share * n_ff)
    n_coord = round(coord * (n_ff - n_gpu))
    roles = [s.role for s in plan.shards]
    assert roles == ["gpu"] + ["cpu"] * n_cpu + (["coordinator"] if n_coord else [])
    assert len({s.worker_id for s in plan.shards}) == len(plan.shards)
    plan.check_partition()
    for layer in range(2):
        assert len(plan.shards[0].neurons[layer]) == n_gpu
        if n_coord:
            own = plan.shards[-1].neurons[layer]
            assert len(own) == n_coord and own.dtype == np.int32
            np.testing.assert_array_equal(own, np.arange(n_ff - n_coord, n_ff))
        cpu = [len(s.neurons[layer]) for s in plan.shards if s.role == "cpu"]
        assert sum(cpu) == n_ff - n_gpu - n_coord and max(cpu) - min(cpu) <= 1


@pytest.mark.parametrize("coord", [-0.1, 1.0, float("nan")])
def test_static_plan_coordinator_share_invalid(coord):
    with pytest.raises(ValueError, match="coordinator share"):
        static_plan(2, 160, 0.0, 1, coord)


def test_head_rows_follow_the_intended_shares_not_the_block_cuts():
    """A K-quant expert's 768 neurons cut on 256-neuron blocks go 512/256 to two processes; the
    head's rows follow the even split they were meant to have (its own phase would otherwise
    wait on the bigger share), and still only processes that hold neurons get rows."""
    cut = static_plan(2, 768, 0.0, 1, 0.5, 256)
    meant = static_plan(2, 768, 0.0, 1, 0.5, 1)
    loads = sorted(sum(len(n) for n in s.neurons) for s in cut.shards if any(len(n) for n in s.neurons))
    assert loads == [512, 1024]  # two layers of 256 and 512
    by_cut = split_vocabulary(cut, 49152, 1 << 20)
    even = split_vocabulary(cut, 49152, 1 << 20, meant)
    assert sorted(by_cut) == sorted(even) == [1, 2]  # the worker with neurons and the coordinator
    rows = lambda split: sorted(b - a for a, b in split.values())  # noqa: E731
    assert rows(by_cut) == [16384, 32768] and rows(even) == [24576, 24576]
    assert sorted(even.values())[0][0] == 0 and sorted(even.values())[-1][1] == 49152
