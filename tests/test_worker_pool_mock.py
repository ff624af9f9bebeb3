"""coordinator.runtime.worker_pool.WorkerPool and the exchange of coordinator.runtime.sparse_ffn against mock workers
(tests/fixtures/mock_worker.py) that speak the real ZMQ/msgpack/shared-memory/doorbell protocol but compute
a known function, so the handshake, x/mask handoff, both the spinning and the sleeping doorbell,
slot summation, failure reporting and cleanup are tested without real weights."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from coordinator.runtime.placement import Plan, WorkerShard, static_plan
from coordinator.runtime import worker_pool
from coordinator.runtime.worker_pool import WorkerError, WorkerPool
from tests.conftest import children_of, hang_guard, shm_segments
from tests.fixtures.mock_pool import (HIDDEN, MAX_TOKENS, MODEL, expected_dense, ffn_of, make_pool, run_ffn,
                                     shuffled_plan, write_x)
from tests.fixtures.mock_worker import compute_us


def assert_all_gone(pool: WorkerPool) -> None:
    live = set(children_of(os.getpid()))
    for w in pool.workers:
        assert w.proc.returncode is not None, f"{w.label} still running after close()"
        assert w.proc.pid not in live
    assert pool.buffers.name not in shm_segments()
    assert not pool.run_dir.exists()


@pytest.fixture(scope="module")
def pool():
    p = make_pool(shuffled_plan(), startup_timeout_s=60)
    try:
        p.wait_ready()
        yield p
    finally:
        p.close()


# ---- the happy path ------------------------------------------------------------------------

def test_handshake(pool):
    assert [w.identity for w in pool.workers] == [b"gpu0", b"cpu5", b"cpu2"]
    for slot, (w, shard) in enumerate(zip(pool.workers, pool.plan.shards)):
        assert w.pid == w.proc.pid  # from Hello
        assert w.device == "mock"   # from Ready
        assert w.n_neurons == sum(len(a) for a in shard.neurons)
        assert w.proc.poll() is None


@pytest.mark.parametrize("n_tokens", [1, 3, MAX_TOKENS])
def test_dense_sum_over_layers_and_steps(pool, n_tokens):
    rng = np.random.default_rng(n_tokens)
    for rep in range(2):
        for layer in range(pool.plan.n_layers):
            write_x(pool, rng, n_tokens)
            want = expected_dense(pool, layer, n_tokens)
            got = run_ffn(pool, layer, n_tokens)
            assert got.shape == (n_tokens, HIDDEN)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want.astype(np.float32))


def test_result_is_not_a_view_of_shared_memory(pool):
    rng = np.random.default_rng(1)
    write_x(pool, rng, 2)
    got = run_ffn(pool, 0, 2)
    keep = got.copy()
    write_x(pool, rng, 2)
    run_ffn(pool, 1, 2)
    pool.buffers.out[:] = -1.0
    np.testing.assert_array_equal(got, keep)


@pytest.mark.parametrize("n_tokens", [1, 4])
def test_sparse_mask_handoff(pool, n_tokens):
    """Each mock writes the number of its owned neurons active in the shared mask into
    out[slot, 0, slot]; the summed row 0 thus holds every worker's count at its slot."""
    rng = np.random.default_rng(10 + n_tokens)
    plan = pool.plan
    masks = [np.zeros(plan.n_ff, np.uint8), np.ones(plan.n_ff, np.uint8)]
    masks += [(rng.random(plan.n_ff) < p).astype(np.uint8) for p in (0.1, 0.5, 0.9)]
    masks.append(np.where(rng.random(plan.n_ff) < 0.5, 0, rng.integers(1, 255, plan.n_ff)).astype(np.uint8))
    for mask in masks:
        for layer in range(plan.n_layers):
            write_x(pool, rng, n_tokens)
            pool.buffers.mask[:] = mask
            got = run_ffn(pool, layer, n_tokens, dense=False)
            counts = [int(np.count_nonzero(mask[s.neurons[layer]])) for s in plan.shards]
            row0 = np.zeros(HIDDEN, np.float32)
            row0[: len(counts)] = counts
            np.testing.assert_array_equal(got[0], row0)
            assert got[0].sum() == np.count_nonzero(mask)
            if n_tokens > 1:
                np.testing.assert_array_equal(got[1:], expected_dense(pool, layer, n_tokens)[1:].astype(np.float32))


def test_sync_stats(pool):
    before = len(ffn_of(pool).stats.round_trip_us)
    assert len(ffn_of(pool).stats.overhead_us) == before
    rng = np.random.default_rng(2)
    for layer in (0, 1, 2, 0):
        write_x(pool, rng, 1)
        run_ffn(pool, layer, 1)
    rt, ov = ffn_of(pool).stats.round_trip_us[before:], ffn_of(pool).stats.overhead_us[before:]
    assert len(rt) == 4 and len(ov) == 4
    slowest = max(compute_us(s.worker_id) for s in pool.plan.shards)
    for r, o in zip(rt, ov):
        assert 0 < r < 5e6
        assert o == pytest.approx(r - slowest)


def test_static_plan_pool_and_close(no_leaks):
    """The pool with a plan straight from static_plan (worker ids == slots), one token and many;
    then close() leaves no process, no segment and no socket directory behind."""
    plan = static_plan(n_layers=2, n_ff=40, gpu_share=0.4, n_cpu_workers=2)
    p = make_pool(plan, startup_timeout_s=60)
    name, run_dir = p.buffers.name, p.run_dir
    try:
        assert name in shm_segments()
        assert run_dir.is_dir()
        p.wait_ready()
        assert set(w.proc.pid for w in p.workers) <= set(children_of(os.getpid()))
        rng = np.random.default_rng(3)
        for n in (1, 5):
            for layer in (1, 0):
                write_x(p, rng, n)
                np.testing.assert_array_equal(run_ffn(p, layer, n), expected_dense(p, layer, n).astype(np.float32))
        assert len(ffn_of(p).stats.round_trip_us) == 4
    finally:
        p.close()
    assert_all_gone(p)
    assert not run_dir.exists()
    assert name not in shm_segments()
    assert [w.proc.returncode for w in p.workers] == [0, 0, 0]  # Shutdown honored, no kill
    p.close()  # idempotent


def test_coordinator_shard_must_come_last(tiny_model, no_leaks):
    idx = np.arange(40, dtype=np.int32)
    plan = Plan(1, 40, [WorkerShard("gpu", 0, [idx[:10]]), WorkerShard("coordinator", 1, [idx[10:20]]),
                        WorkerShard("cpu", 2, [idx[20:]])])
    with pytest.raises(ValueError, match="coordinator shard"):
        WorkerPool(tiny_model, plan, hidden=8, max_tokens=4)


def test_single_worker_pool(no_leaks):
    plan = static_plan(n_layers=1, n_ff=40, gpu_share=1.0, n_cpu_workers=0)
    with make_pool(plan, startup_timeout_s=60) as p:
        p.wait_ready()
        rng = np.random.default_rng(4)
        write_x(p, rng, 3)
        got = run_ffn(p, 0, 3)
        want = p.buffers.x[:3].copy()  # worker id 0, layer 0: y = x * 1 + 0
        np.testing.assert_array_equal(got, want)
        p.buffers.out[:] = -1.0  # the returned array must not be a view of the slot
        np.testing.assert_array_equal(got, want)
    assert_all_gone(p)


@pytest.mark.parametrize("spin", [True, False], ids=["spinning", "sleeping"])
def test_every_worker_is_waited_for(no_leaks, spin):
    """One worker computes slowly (past the coordinator's spin), one never spins (every step
    rings its wake pipe): the exchange must wait for each current step before summing, on
    both the spinning and the sleeping path of the doorbell."""
    plan = shuffled_plan(seed=1)
    with make_pool(plan, behaviors={5: "slow_ffn", 2: "sleeper"}, startup_timeout_s=60, spin=spin) as p:
        p.wait_ready()
        rng = np.random.default_rng(5)
        for layer in (0, 1, 2):
            write_x(p, rng, 2)
            np.testing.assert_array_equal(run_ffn(p, layer, 2), expected_dense(p, layer, 2).astype(np.float32))
        assert p.bell.wakeups >= 3  # the sleeper was rung for each step
    assert_all_gone(p)


# ---- failures ---------------------------------------------------------------------------------

def test_fail_load(no_leaks):
    p = make_pool(shuffled_plan(), behaviors={2: "fail_load"}, startup_timeout_s=60)
    try:
        with pytest.raises(WorkerError) as e:
            p.wait_ready()
        msg = str(e.value)
        assert "cpu worker 2" in msg
        assert f"mock cannot load {MODEL}" in msg
        assert "cpu worker 5" not in msg and "gpu worker" not in msg
    finally:
        p.close()
    assert_all_gone(p)


def test_die_at_start(no_leaks):
    """Found dead, not waited for: the error is the exit, not the 60 s startup timeout (which
    bounds this wait, so it cannot hang)."""
    p = make_pool(shuffled_plan(), behaviors={0: "die_at_start"}, startup_timeout_s=60)
    try:
        with pytest.raises(WorkerError, match=r"gpu worker 0 \(pid \d+\) died: exited with code 5"):
            p.wait_ready()
    finally:
        p.close()
    assert_all_gone(p)


class _Clock:
    """worker_pool's `time`, recording every monotonic() the pool reads (its deadline's clock)."""

    def __init__(self):
        self.readings: list[float] = []

    def monotonic(self) -> float:
        self.readings.append(time.monotonic())
        return self.readings[-1]

    def __getattr__(self, name):
        return getattr(time, name)


def test_slow_ready_times_out(no_leaks, monkeypatch):
    """A worker that never says Ready ends the wait with the startup timeout, naming only it:
    the pool gave up only once its own clock had passed its deadline (its first reading plus
    startup_timeout_s: not earlier), and the hang guard, 12x that, catches a pool that never gives up."""
    # Long enough for the healthy mocks to start on a loaded 2-core machine.
    p = make_pool(shuffled_plan(), behaviors={5: "slow_ready"}, startup_timeout_s=5)
    try:
        clock = _Clock()
        monkeypatch.setattr(worker_pool, "time", clock)
        with hang_guard("waiting for a worker that never says Ready"):
            with pytest.raises(WorkerError, match="timed out") as e:
                p.wait_ready()
        monkeypatch.undo()
        assert clock.readings[-1] - clock.readings[0] > p.startup_timeout_s
        msg = str(e.value)
        slow = next(w for w in p.workers if w.worker_id == 5)
        assert f"cpu worker 5 (pid {slow.proc.pid})" in msg
        assert "cpu worker 2" not in msg and "gpu worker 0" not in msg  # those were ready
    finally:
        p.close()
    assert_all_gone(p)
    assert slow.proc.returncode < 0  # ignored Shutdown while "loading": killed


def test_close_before_hello_terminates_at_once(no_leaks):
    """Closed before its workers said Hello (Ctrl-C while they import): each is terminated
    (SIGTERM), not sent a Shutdown it cannot receive yet and killed (SIGKILL) after the 2 s
    grace period. Checked by how they ended, not by a clock."""
    p = make_pool(shuffled_plan(), startup_timeout_s=60)
    p.spawn()
    p.close()
    assert {w.worker_id: w.proc.returncode for w in p.workers} == {0: -signal.SIGTERM, 5: -signal.SIGTERM,
                                                                    2: -signal.SIGTERM}
    assert_all_gone(p)


def test_die_on_ffn(no_leaks):
    """The step during which a worker dies is the one that fails, naming it (a wait that no
    longer notices the death would never end: the hang guard fails it)."""
    p = make_pool(shuffled_plan(), behaviors={5: "die_on_ffn"}, startup_timeout_s=60)
    try:
        p.wait_ready()
        rng = np.random.default_rng(6)
        for layer in (0, 1):
            write_x(p, rng, 1)
            run_ffn(p, layer, 1)
        with hang_guard("the step of a dead worker"):
            with pytest.raises(WorkerError) as e:
                run_ffn(p, 2, 1)
        msg = str(e.value)
        assert "cpu worker 5" in msg and "died" in msg and "exited with code 3" in msg
    finally:
        p.close()
    assert_all_gone(p)
    codes = {w.worker_id: w.proc.returncode for w in p.workers}
    assert codes == {0: 0, 5: 3, 2: 0}


def test_fail_on_ffn(no_leaks):
    p = make_pool(shuffled_plan(), behaviors={0: "fail_on_ffn"}, startup_timeout_s=60)
    try:
        p.wait_ready()
        run_ffn(p, 0, 1)
        with pytest.raises(WorkerError, match=r"gpu worker 0 .*mock compute error at layer 1"):
            run_ffn(p, 1, 1)
    finally:
        p.close()
    assert_all_gone(p)
