"""The wake pipe a sleeping process polls: a ring from another process wakes it, rings never
block the ringer (even when nobody drains), and the pool removes the pipes with its run dir."""
import os
import select
import signal
import time

from coordinator.runtime.placement import static_plan
from coordinator.runtime.worker_pool import WorkerPool
from protocol.doorbell import WakePipe
from tests.conftest import HANG_S


def test_ring_wakes_a_poller_in_another_process(tmp_path):
    pipe = WakePipe.create(str(tmp_path / "w.wake"))
    assert not select.select([pipe], [], [], 0)[0]  # nothing rung yet
    pid = os.fork()
    if pid == 0:  # the ringer opens the FIFO by path, as a worker does
        try:
            time.sleep(0.05)
            WakePipe(str(tmp_path / "w.wake")).ring()
        finally:
            os._exit(0)
    # the ring is what wakes the poll; the poll's own limit only catches a ring that never comes
    readable = select.select([pipe], [], [], HANG_S)[0]
    os.waitpid(pid, 0)
    assert readable, f"no ring within {HANG_S:g} s"
    pipe.drain()
    assert not select.select([pipe], [], [], 0)[0]  # drained: the next poll sleeps again
    pipe.close()


def test_ringing_a_full_pipe_does_not_block(tmp_path):
    pipe = WakePipe.create(str(tmp_path / "w.wake"))
    other = WakePipe(pipe.path)
    def blocked(*_):
        raise AssertionError("ring() blocked on a full pipe")

    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(30)
    try:
        for _ in range(200_000):  # far more than a pipe buffer holds
            other.ring()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    pipe.drain()
    assert not select.select([pipe], [], [], 0)[0]
    pipe.close(), other.close()


def test_pool_makes_one_pipe_per_slot_and_removes_them(tmp_path):
    plan = static_plan(2, 8, 0.0, 2)
    pool = WorkerPool(tmp_path / "model.gguf", plan, hidden=4, max_tokens=2)
    paths = [pool.bell.wake.path] + [w.path for w in pool.bell.worker_wakes]
    try:
        assert len(paths) == 1 + len(plan.shards) == len(set(paths))
        assert all(os.path.exists(p) for p in paths)
    finally:
        pool.close()
    assert not any(os.path.exists(p) for p in paths)
    assert not os.path.exists(pool.run_dir)
    assert pool.bell.wake.fd == -1
