"""Real workers (gpu_worker + cpu_worker processes, default launcher) compute the exact FFN:
the sum of their partial outputs equals a dense reference computed here from weights read
independently with gguf.GGUFReader + gguf.quants.dequantize, with the active mask applied."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from coordinator.runtime.placement import static_plan
from tests.fixtures.exchange_rig import Rig
from tests.fixtures.ffn_reference import ffn_dense_reference
from sparsecore.ffn import ACTIVATIONS
from tests.conftest import shm_segments
from tests.fixtures.ffn_checks import assert_close, read_ffn_weights, threshold_with_gap

MAX_TOKENS = 8
GPU_SHARE, N_CPU = 0.4, 2


def reference(weights, layer: int, x: np.ndarray, activation: str, mask: np.ndarray | None) -> np.ndarray:
    gate, up, down = (torch.from_numpy(a) for a in weights[layer])
    m = None if mask is None else torch.from_numpy(mask.astype(np.float64))
    return ffn_dense_reference(torch.from_numpy(x.astype(np.float64)), gate, up, down, activation, m).numpy()


COORDINATOR_SHARE = 0.3  # the "+coordinator" setups: the coordinator computes this share itself


@pytest.fixture(scope="module", params=["F32", "Q8_0", "F32+coordinator", "Q8_0+coordinator"])
def setup(request, tiny_model, tiny_model_factory):
    tensor_type, _, coordinator = request.param.partition("+")
    path = tiny_model if tensor_type == "F32" else tiny_model_factory(tensor_type=tensor_type)
    weights, hidden, n_ff, activation = read_ffn_weights(path)
    plan = static_plan(len(weights), n_ff, GPU_SHARE, N_CPU, COORDINATOR_SHARE if coordinator else 0.0)
    # With a coordinator shard the lm_head's rows are split too (test_split_lm_head).
    pool = Rig(path, plan, hidden=hidden, max_tokens=MAX_TOKENS, threads_per_worker=1,
               split_lm_head=bool(coordinator))
    try:
        yield pool, weights, activation
    finally:
        pool.close()
    assert all(w.proc.returncode is not None for w in pool.workers)
    assert pool.buffers.name not in shm_segments()
    assert not pool.run_dir.exists()


def run(pool: Rig, layer: int, x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    n = len(x)
    pool.buffers.x[:] = np.nan  # rows past n_tokens must not leak into the result
    pool.buffers.x[:n] = x
    if mask is None:
        pool.buffers.mask[:] = 0  # ignored on dense steps
        return pool.run_ffn(layer, n, dense=True)
    pool.buffers.mask[:] = mask
    return pool.run_ffn(layer, n, dense=False)


def test_both_worker_kinds_own_neurons(setup):
    pool, weights, _ = setup
    roles = [w.role for w in pool.workers]
    assert roles == ["gpu", "cpu", "cpu"]
    n_ff = pool.plan.n_ff
    procs = [s for s in pool.plan.shards if s.role != "coordinator"]
    assert [w.n_neurons for w in pool.workers] == [len(weights) * len(s.neurons[0]) for s in procs]
    if pool.own_slot is not None:  # the rest is the coordinator's, computed in this process
        local = pool.plan.shards[pool.own_slot]
        assert local.role == "coordinator" and pool.own_slot == len(pool.workers)
        assert len(local.neurons[0]) == round(COORDINATOR_SHARE * (n_ff - round(GPU_SHARE * n_ff))) > 0
        assert sorted(pool.ffn.own.layers) == list(weights) and pool.ffn.own.nbytes > 0
    assert pool.workers[0].n_neurons == len(weights) * round(GPU_SHARE * n_ff)
    assert all(w.n_neurons > 0 for w in pool.workers)
    assert all(w.proc.poll() is None and w.pid == w.proc.pid for w in pool.workers)


@pytest.mark.parametrize("n_tokens", [1, 5])
def test_dense(setup, n_tokens):
    pool, weights, act = setup
    rng = np.random.default_rng(n_tokens)
    for layer in weights:
        x = rng.standard_normal((n_tokens, pool.buffers.layout.hidden)).astype(np.float32)
        got = run(pool, layer, x, None)
        assert got.dtype == np.float32
        assert_close(got, reference(weights, layer, x, act, None))


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_sparse_masks(setup, n_tokens):
    pool, weights, act = setup
    n_ff, hidden = pool.plan.n_ff, pool.buffers.layout.hidden
    rng = np.random.default_rng(100 + n_tokens)
    masks = {f"p{p}": (rng.random(n_ff) < p).astype(np.uint8) for p in (0.05, 0.3, 0.7)}
    masks["full"] = np.ones(n_ff, np.uint8)
    for layer in weights:
        for name, mask in masks.items():
            x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
            got = run(pool, layer, x, mask)
            want = reference(weights, layer, x, act, mask)
            assert_close(got, want)
            # the mask really is applied: the dense answer differs unless every neuron is active
            if name != "full":
                dense = reference(weights, layer, x, act, None)
                assert np.abs(dense - want).max() > 1e-2 * np.abs(dense).max()


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_threshold_steps(setup, n_tokens):
    """Threshold steps: every process keeps, per token, the neurons with |act(gate x)| above the
    layer's threshold in shared memory, and reports how many neuron-token pairs it computed."""
    pool, weights, act = setup
    if act == "relu":
        pytest.skip("thresholds are for SwiGLU models")
    rng = np.random.default_rng(200 + n_tokens)
    for layer in weights:
        gate, up, down = (torch.from_numpy(a) for a in weights[layer])
        x = rng.standard_normal((n_tokens, pool.buffers.layout.hidden)).astype(np.float32)
        x64 = torch.from_numpy(x.astype(np.float64))
        g = ACTIVATIONS[act](x64 @ gate.T)
        thr = threshold_with_gap(g.numpy())
        keep = g.abs() > thr
        pool.buffers.x[:n_tokens] = x
        pool.buffers.thresholds[layer] = thr
        before = pool.stats.active.get(layer, 0)
        got = pool.run_ffn(layer, n_tokens, dense=False, threshold=True)
        assert_close(got, ((g * keep * (x64 @ up.T)) @ down.T).numpy())
        assert pool.stats.active[layer] - before == int(keep.sum()) < keep.numel()


def test_full_mask_equals_dense(setup):
    pool, weights, _ = setup
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, pool.buffers.layout.hidden)).astype(np.float32)
    for layer in weights:
        sparse = run(pool, layer, x, np.ones(pool.plan.n_ff, np.uint8))
        dense = run(pool, layer, x, None)
        np.testing.assert_allclose(sparse, dense, rtol=1e-5, atol=1e-6 * np.abs(dense).max())


def test_empty_mask_is_exactly_zero(setup):
    pool, weights, _ = setup
    rng = np.random.default_rng(8)
    for layer in weights:
        for n in (1, 4):
            x = rng.standard_normal((n, pool.buffers.layout.hidden)).astype(np.float32)
            pool.buffers.out[:] = 123.0  # stale slot contents must be overwritten
            got = run(pool, layer, x, np.zeros(pool.plan.n_ff, np.uint8))
            assert got.shape == (n, pool.buffers.layout.hidden)
            assert np.all(got == 0.0)


def test_each_worker_kind_alone(setup):
    """A mask that activates only one worker's neurons: that worker's partial is the whole answer,
    so each kind (and each CPU shard) is checked on its own."""
    pool, weights, act = setup
    rng = np.random.default_rng(9)
    for layer in weights:
        for shard in pool.plan.shards:
            mask = np.zeros(pool.plan.n_ff, np.uint8)
            own = shard.neurons[layer]
            mask[own[rng.random(len(own)) < 0.6]] = 1
            assert mask.any()
            x = rng.standard_normal((2, pool.buffers.layout.hidden)).astype(np.float32)
            got = run(pool, layer, x, mask)
            assert_close(got, reference(weights, layer, x, act, mask))


def test_split_lm_head(setup):
    """Each CPU worker and the coordinator compute their vocabulary rows of the lm_head; side by
    side they equal the head read independently (GGUFReader + dequantize)."""
    pool, weights, _ = setup
    if pool.own_slot is None:
        assert pool.head is None and not pool.head_rows
        return
    r = gguf.GGUFReader(pool.model_path)
    t = next(t for t in r.tensors if t.name == "output.weight")
    head = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(
        tuple(int(d) for d in reversed(t.shape)))
    n_vocab = head.shape[0]
    own = pool.ffn.own.head
    ranges = sorted(pool.head_rows.values())
    assert ranges[-1] == (own.start, own.stop)  # the coordinator's rows are the last ones
    assert ranges[0][0] == 0 and ranges[-1][1] == n_vocab
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
    assert sorted(pool.head_rows) == [0, 1, 2, 3]  # every worker that computes FFN neurons (GPU_SHARE > 0)
    rng = np.random.default_rng(11)
    for _ in range(3):
        x = rng.standard_normal(pool.buffers.layout.hidden).astype(np.float32)
        pool.buffers.out[:] = np.nan  # every logit must come from this step
        got = pool.head(x[None])[0]
        want = head @ x.astype(np.float64)
        assert got.shape == (n_vocab,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert len(pool.stats.head_us) == 3


def test_workers_still_alive(setup):
    pool, _, _ = setup
    assert all(w.proc.poll() is None for w in pool.workers)
    assert len(pool.stats.round_trip_us) + len(pool.stats.head_us) == pool.bell.step
    # names removed once every worker was ready (nothing survives a kill -9); the pool works on
    assert not os.path.exists(pool.run_dir)
    assert pool.buffers.name not in shm_segments()
