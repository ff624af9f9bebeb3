"""A stand-in worker that speaks the real protocol (ZMQ DEALER + msgpack messages + shared memory)
but computes a known function instead of an FFN, for testing coordinator.worker_pool.

    python tests/mock_worker.py --endpoint E --worker-id N [--role cpu] [--behavior ok]

Identity f"{role}{id}", Hello -> Assign -> attach SharedBuffers -> Ready, then per Ffn:
    dense:   out[slot, :n] = x[:n] * (worker_id + 1) + layer
    sparse:  the same, then row 0 is replaced by zeros except out[slot, 0, slot] = number of this
             worker's owned neurons of `layer` that are active in the shared mask
and reply Done(compute_us = 10 * (worker_id + 1)). It never uses the shared-memory doorbell: its
slot says it sleeps, so every step comes as an Ffn message and every answer goes back as Done
(the pool's fallback path; the real workers' doorbell is tested end to end). It imports neither
torch nor sparsecore, so it starts fast.

Behaviors:
    ok            as above
    fail_load     answer the Assign with WorkerFailed("mock cannot load <model_path>"), exit 1
    die_at_start  exit with code 5 before saying Hello
    die_on_ffn    exit with code 3 on receiving the 3rd Ffn, without replying
    fail_on_ffn   answer the 2nd Ffn with WorkerFailed("mock compute error at layer L"), exit 1
    dup_done      reply to every Ffn with two identical Done messages at once
    stale_done    on every Ffn after the first, first send a Done for the previous step, then
                  sleep 0.3 s, then compute and reply (a pool that took the stale Done for the
                  current one would return before this worker wrote its output)
    slow_ffn      sleep 0.3 s before computing each Ffn
    slow_ready    after the Assign, sleep (ignoring every message) instead of saying Ready
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

from protocol.messages import (Assign, Done, Ffn, Hello, Ready, Shutdown, WorkerFailed,  # noqa: E402
                               decode, encode)
from protocol.shm_layout import SLOT_SLEEPING, SharedBuffers  # noqa: E402

BEHAVIORS = ("ok", "fail_load", "die_at_start", "die_on_ffn", "fail_on_ffn", "dup_done", "stale_done",
             "slow_ffn", "slow_ready")


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
        send(Hello(wid, role, os.getpid()))
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
        buffers.slots[slot, SLOT_SLEEPING] = 1  # always asleep: steps come as Ffn messages
        send(Ready(wid, role, os.getpid(), sum(len(v) for v in owned.values()), "mock", 0.0))
        n_ffn, last_step = 0, -1
        while True:
            m = decode(sock.recv())
            if isinstance(m, Shutdown):
                return 0
            if not isinstance(m, Ffn):
                continue
            n_ffn += 1
            if behavior == "die_on_ffn" and n_ffn == 3:
                os._exit(3)
            if behavior == "fail_on_ffn" and n_ffn == 2:
                send(WorkerFailed(wid, role, f"mock compute error at layer {m.layer}"))
                return 1
            if behavior == "stale_done" and n_ffn > 1:
                send(Done(wid, m.layer, last_step, compute_us(wid), 0))
                time.sleep(0.3)
            if behavior == "slow_ffn":
                time.sleep(0.3)
            last_step = m.step
            n = m.n_tokens
            y = buffers.x[:n] * np.float32(wid + 1) + np.float32(m.layer)
            idx = owned[m.layer]
            n_active = len(idx)
            if not m.dense:
                n_active = int(np.count_nonzero(buffers.mask[idx]))
                y[0] = 0.0
                y[0, slot] = n_active
            buffers.out[slot, :n] = y
            done = Done(wid, m.layer, m.step, compute_us(wid), n_active)
            send(done)
            if behavior == "dup_done":
                send(done)
    finally:
        if buffers is not None:
            buffers.close()
        sock.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
