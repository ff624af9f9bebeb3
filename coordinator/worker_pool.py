"""Start the worker processes, run the per-layer FFN exchange with them, stop them cleanly.

Per layer: the caller has written x (and the active mask) into shared memory; run_ffn sends one
Ffn message to every worker, waits for every Done, and sums the workers' output slots. While
waiting it polls in short slices and checks each process, so a dead worker is reported by
name within a fraction of a second instead of hanging the token loop.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import zmq

from protocol.addresses import COORDINATOR_PID_ENV, private_runtime_dir, worker_endpoint
from protocol.messages import Assign, Done, Ffn, Hello, Ready, Shutdown, WorkerFailed, decode, encode
from protocol.shm_layout import SharedBuffers, ShmLayout

from .placement import Plan, WorkerShard

POLL_SLICE_MS = 100
DEATH_CHECK_S = 0.2


class WorkerError(RuntimeError):
    """A worker failed to start, reported a failure, or died."""


@dataclass
class WorkerProc:
    role: str
    worker_id: int
    proc: subprocess.Popen
    identity: bytes
    n_neurons: int = 0
    device: str = ""
    pid: int = 0
    weight_bytes: int = 0

    @property
    def label(self) -> str:
        return f"{self.role} worker {self.worker_id} (pid {self.proc.pid})"

    def exit_reason(self) -> str:
        rc = self.proc.returncode
        if rc is None:
            return "running"
        return f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"


Launcher = Callable[[WorkerShard, str], list]


def default_launcher(shard: WorkerShard, endpoint: str) -> list:
    module = "gpu_worker" if shard.role == "gpu" else "cpu_worker"
    return [sys.executable, "-m", module, "--endpoint", endpoint, "--worker-id", str(shard.worker_id)]


# Workers get a process group of their own, so a terminal's Ctrl-C (SIGINT to the foreground
# group) reaches only the coordinator, which then stops them. Otherwise a worker still importing
# torch (before it ignores SIGINT) dies of it with a KeyboardInterrupt traceback on the terminal.
# When the coordinator dies (of a SIGHUP or anything else), PR_SET_PDEATHSIG still ends them.
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {}


@dataclass
class SyncStats:
    round_trip_us: list[float] = field(default_factory=list)
    overhead_us: list[float] = field(default_factory=list)  # round trip minus slowest worker's compute
    active: dict[int, int] = field(default_factory=dict)  # layer -> (neuron, token) pairs computed
    tokens: dict[int, int] = field(default_factory=dict)  # layer -> tokens through that layer


def _worker_env(threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # never spin on cores another process computes on
    # A worker that is still importing when the coordinator dies must notice it: see
    # sparsecore.worker_runtime.main (PR_SET_PDEATHSIG only covers deaths after it is set).
    env[COORDINATOR_PID_ENV] = str(os.getpid())
    # Make the repo importable when running from a checkout without installing.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class WorkerPool:
    def __init__(self, model_path: Path, plan: Plan, hidden: int, max_tokens: int,
                 threads_per_worker: int = 1, gpu_device: str = "auto", transport: str = "ipc",
                 startup_timeout_s: float = 120.0, launcher: Launcher | None = None, weights: str = "f32"):
        self.model_path = Path(model_path).resolve()
        self.plan = plan
        self.threads = threads_per_worker
        self.gpu_device = gpu_device
        self.weights = weights
        self.startup_timeout_s = startup_timeout_s
        self.launcher = launcher or default_launcher
        self.workers: list[WorkerProc] = []
        self.stats = SyncStats()
        self.step = 0
        self.run_dir = private_runtime_dir()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(worker_endpoint(self.run_dir, transport))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        layout = ShmLayout(hidden, plan.n_ff, max_tokens, len(plan.shards), plan.n_layers)
        self.buffers = SharedBuffers.create(layout)
        self.closed = False

    # ---- startup ------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the worker processes; they import and connect while the coordinator loads."""
        for shard in self.plan.shards:
            cmd = self.launcher(shard, self.endpoint)
            proc = subprocess.Popen(cmd, env=_worker_env(self.threads), stdin=subprocess.DEVNULL, **_OWN_GROUP)
            self.workers.append(WorkerProc(shard.role, shard.worker_id, proc, f"{shard.role}{shard.worker_id}".encode()))

    def wait_ready(self) -> None:
        """Handshake: answer each Hello with an Assign, wait for every Ready (or a failure)."""
        if not self.workers:
            self.spawn()
        by_identity = {w.identity: (slot, w) for slot, w in enumerate(self.workers)}
        pending_ready = set(by_identity)
        deadline = time.monotonic() + self.startup_timeout_s
        while pending_ready:
            if time.monotonic() > deadline:
                names = ", ".join(by_identity[i][1].label for i in sorted(pending_ready))
                raise WorkerError(f"timed out after {self.startup_timeout_s:.0f}s waiting for: {names}")
            got = self._recv(POLL_SLICE_MS)
            if got is None:
                self._check_alive()
                continue
            ident, msg = got
            slot, w = by_identity[ident]
            if isinstance(msg, Hello):
                w.pid = msg.pid
                shard = self.plan.shards[slot]
                layers = list(range(self.plan.n_layers))
                neurons = [np.asarray(shard.neurons[l], dtype=np.int32).tobytes() for l in layers]
                dev = self.gpu_device if shard.role == "gpu" else "cpu"
                self._send(ident, Assign(str(self.model_path), self.buffers.name, slot, layers, neurons,
                                         self.threads, dev, self.weights))
            elif isinstance(msg, Ready):
                w.n_neurons, w.device, w.weight_bytes = msg.n_neurons, msg.device, msg.weight_bytes
                pending_ready.discard(ident)
            elif isinstance(msg, WorkerFailed):
                raise WorkerError(f"{w.label} failed while loading: {msg.reason}")

    # ---- per-layer exchange -------------------------------------------------------------

    def run_ffn(self, layer: int, n_tokens: int, dense: bool = True, threshold: bool = False) -> np.ndarray:
        """Ask every worker for its partial FFN of `layer`; return the sum, shape (n_tokens, hidden).
        The number of (neuron, token) pairs computed is added to self.stats.active[layer]."""
        if not 1 <= n_tokens <= self.buffers.layout.max_tokens:
            raise ValueError(f"n_tokens {n_tokens} outside 1..{self.buffers.layout.max_tokens}")
        self.step += 1
        t0 = time.perf_counter()
        for w in self.workers:
            self._send(w.identity, Ffn(layer, self.step, n_tokens, dense, threshold))
        waiting = {w.identity for w in self.workers}  # a set: a duplicate Done counts once
        slowest_us = 0.0
        last_check = time.monotonic()
        while waiting:
            got = self._recv(POLL_SLICE_MS)
            if got is None or time.monotonic() - last_check > DEATH_CHECK_S:
                self._check_alive()
                last_check = time.monotonic()
                if got is None:
                    continue
            ident, msg = got
            if isinstance(msg, Done) and msg.step == self.step:
                if ident in waiting:
                    self.stats.active[layer] = self.stats.active.get(layer, 0) + msg.n_active
                waiting.discard(ident)
                slowest_us = max(slowest_us, msg.compute_us)
            elif isinstance(msg, WorkerFailed):
                raise WorkerError(f"{self._by_ident(ident).label} failed: {msg.reason}")
        self.stats.tokens[layer] = self.stats.tokens.get(layer, 0) + n_tokens
        rt = (time.perf_counter() - t0) * 1e6
        self.stats.round_trip_us.append(rt)
        self.stats.overhead_us.append(rt - slowest_us)
        out = self.buffers.out[:, :n_tokens]
        return out.sum(axis=0) if len(self.workers) > 1 else out[0].copy()

    # ---- plumbing -----------------------------------------------------------------------

    def _by_ident(self, ident: bytes) -> WorkerProc:
        return next(w for w in self.workers if w.identity == ident)

    def _send(self, ident: bytes, msg) -> None:
        try:
            self.sock.send_multipart([ident, encode(msg)])
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
            self._check_alive()
            raise WorkerError(f"cannot reach {self._by_ident(ident).label}: {e}") from None

    def _recv(self, timeout_ms: int):
        if not self.sock.poll(timeout_ms):
            return None
        ident, data = self.sock.recv_multipart()
        return ident, decode(data)

    def _check_alive(self) -> None:
        for w in self.workers:
            if w.proc.poll() is not None:
                raise WorkerError(f"{w.label} died: {w.exit_reason()}")

    def close(self) -> None:
        """Stop every worker (politely, then by force), unlink shared memory, remove sockets."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            if w.proc.poll() is None:
                if not w.pid:  # never said Hello (still importing): holds nothing, may not be reachable
                    w.proc.terminate()
                    continue
                try:
                    self.sock.send_multipart([w.identity, encode(Shutdown())], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 2.0
        for w in self.workers:
            try:
                w.proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        self.sock.close(0)
        self.ctx.term()
        self.buffers.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
