"""A stand-in worker that speaks the real protocol (ZMQ DEALER + msgpack messages + shared memory
+ the doorbell of protocol/doorbell.py, both its spinning and its sleeping path) but computes a
known function instead of an FFN, for testing coordinator.worker_pool and coordinator.sparse_ffn.

    python tests/mock_worker.py --endpoint E --worker-id N [--role cpu] [--behavior ok]

Identity f"{role}{id}", Hello -> Assign -> attach SharedBuffers -> Ready, then per step:
    dense:   out[slot, :n] = x[:n] * (worker_id + 1) + layer
    sparse:  the same, then row 0 is replaced by zeros except out[slot, 0, slot] = number of this
             worker's owned neurons of `layer` that are active in the shared mask
and finish with compute_ns = 10 us * (worker_id + 1). It imports neither torch nor sparsecore,
so it starts fast.

Behaviors:
    ok            as above
    fail_load     answer the Assign with WorkerFailed("mock cannot load <model_path>"), exit 1
    die_at_start  exit with code 5 before saying Hello
    die_on_ffn    exit with code 3 on its 3rd step, without finishing it
    fail_on_ffn   answer its 2nd step with WorkerFailed("mock compute error at layer L"), exit 1
    slow_ffn      sleep 0.3 s before computing each step (the coordinator gives up spinning)
    sleeper       never spin, whatever the Assign says: every step comes through the wake pipe
    slow_ready    after the Assign, sleep (ignoring every message) instead of saying Ready
    no_secret     say Hello without the run's secret (as a foreign process would), then wait
    junk_after_ready  after Ready, send 9 bytes that are no message, then serve as ok
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from protocol.doorbell import GONE, MESSAGE, WakePipe, WorkerBell  # noqa: E402
from protocol.addresses import read_secret  # noqa: E402
from protocol.messages import Assign, Hello, Ready, Shutdown, WorkerFailed, decode, encode  # noqa: E402
from protocol.shm_layout import SharedBuffers  # noqa: E402

BEHAVIORS = ("ok", "fail_load", "die_at_start", "die_on_ffn", "fail_on_ffn", "slow_ffn", "sleeper", "slow_ready",
             "no_secret", "junk_after_ready")


def compute_us(worker_id: int) -> float:
    return 10.0 * (worker_id + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--role", default="cpu")
    ap.add_argument("--behavior", default="ok", choices=BEHAVIORS)
    args = ap.parse_args(argv)
    wid, role, behavior = args.worker_id, args.role, args.behavior
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # die with the test process, like the real worker
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except OSError:
        pass
    if behavior == "die_at_start":
        return 5

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{role}{wid}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.endpoint)
    send = lambda m: sock.send(encode(m))  # noqa: E731
    buffers = None
    try:
        send(Hello(wid, role, os.getpid(), "" if behavior == "no_secret" else read_secret()))
        a = decode(sock.recv())
        if not isinstance(a, Assign):
            return 2
        if behavior == "fail_load":
            send(WorkerFailed(wid, role, f"mock cannot load {a.model_path}"))
            return 1
        if behavior == "slow_ready":
            time.sleep(600)
            return 0
        owned = {layer: np.frombuffer(raw, dtype=np.int32) for layer, raw in zip(a.layers, a.neurons)}
        buffers = SharedBuffers.attach(a.shm_name)
        slot = a.slot
        spin_s = 0.0 if behavior == "sleeper" else a.spin_us / 1e6
        bell = WorkerBell(buffers, slot, WakePipe(a.wake_pipe), WakePipe(a.coordinator_pipe), spin_s, sock,
                          lambda layer: len(owned.get(layer, ())) > 0)
        send(Ready(wid, role, os.getpid(), sum(len(v) for v in owned.values()), "mock", 0.0))
        if behavior == "junk_after_ready":
            sock.send(b"\xc1junk9byt")
        n_steps = 0
        while True:
            req = bell.wait()
            if req is GONE:
                return 0
            if req is MESSAGE:
                if isinstance(decode(sock.recv()), Shutdown):
                    return 0
                continue
            n_steps += 1
            if behavior == "die_on_ffn" and n_steps == 3:
                os._exit(3)
            if behavior == "fail_on_ffn" and n_steps == 2:
                send(WorkerFailed(wid, role, f"mock compute error at layer {req.layer}"))
                return 1
            if behavior == "slow_ffn":
                time.sleep(0.3)
            n = req.n_tokens
            y = buffers.x[:n] * np.float32(wid + 1) + np.float32(req.layer)
            idx = owned[req.layer]
            n_active = len(idx) * n
            if not req.dense:
                n_active = int(np.count_nonzero(buffers.mask[idx]))
                y[0] = 0.0
                y[0, slot] = n_active
            buffers.out[slot, :n] = y
            bell.finish(req.step, n_active, int(compute_us(wid) * 1e3))
    finally:
        if buffers is not None:
            buffers.close()
        sock.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
