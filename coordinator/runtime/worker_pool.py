"""Process supervision of the workers: spawn, handshake, liveness, shutdown. Nothing per token.

The pool owns what a run's processes share and must not outlive it: the private run directory
(ipc socket, wake pipes), the ZeroMQ socket, the shared-memory segment and the coordinator's
end of the doorbell (`bell`). The per-layer exchange itself is coordinator/runtime/sparse_ffn.py; it
calls `check_alive` (through the bell) while it waits, so a dead or failing worker ends the
wait with its name within a fraction of a second instead of hanging the token loop.

A plan may end with a "coordinator" shard: neurons the coordinator computes itself. It gets an
output slot (`own_slot`, the last one) but no process.
"""
from __future__ import annotations

import hmac
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import zmq

from protocol.addresses import (COORDINATOR_PID_ENV, SECRET_FILE_ENV, private_runtime_dir, worker_endpoint,
                                write_secret)
from protocol.doorbell import WORKER_SPIN_US, CoordinatorBell, WakePipe, choose_spin
from protocol.messages import Assign, Hello, ProtocolError, Ready, Shutdown, WorkerFailed, decode, encode
from protocol.shm_layout import SharedBuffers, ShmLayout, new_segment_name

from .placement import Plan, WorkerShard
from .reaper import start_reaper

POLL_SLICE_MS = 100
# How often the start-up thread that answers Hellos (WorkerPool.spawn) checks whether to stop.
HANDSHAKE_SLICE_MS = 10
DEATH_CHECK_S = 0.2
# Workers send only small messages (Hello, Ready, WorkerFailed); ZeroMQ drops a peer that
# sends more, before it is read into memory.
MAX_WORKER_MESSAGE = 1 << 20


class WorkerError(RuntimeError):
    """A worker failed to start, reported a failure, or died."""


@dataclass
class WorkerProc:
    role: str
    worker_id: int
    slot: int
    proc: subprocess.Popen
    identity: bytes
    n_neurons: int = 0
    device: str = ""
    pid: int = 0
    weight_bytes: int = 0
    predicts: bool = False  # scores its own neurons in FLAG_PREDICT steps (Ready.predicts)
    lockstep: bool = False  # takes part in lockstep decode steps (Ready.lockstep)
    experts: bytes = b""  # a routed model's experts it holds rows of (Ready.experts)

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


def _worker_env(threads: int, secret_path: Path | None = None) -> dict:
    """The environment of a worker process: its own thread counts and wait policy, set here for
    the child only (never exported into an environment other programs inherit)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # never spin on cores another process computes on
    # A worker that is still importing when the coordinator dies must notice it: see
    # sparsecore/lifeline.py (PR_SET_PDEATHSIG only covers deaths after it is set).
    env[COORDINATOR_PID_ENV] = str(os.getpid())
    if secret_path is not None:
        env[SECRET_FILE_ENV] = str(secret_path)
    # Make the repo importable when running from a checkout without installing.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class WorkerPool:
    def __init__(self, model_path: Path, plan: Plan, hidden: int, max_tokens: int,
                 threads_per_worker: int = 1, gpu_device: str = "auto", transport: str = "ipc",
                 startup_timeout_s: float = 120.0, launcher: Launcher | None = None, weights: str = "f32",
                 spin: bool | None = None, cores: int | None = None,
                 head_rows: dict[int, tuple[int, int]] | None = None, fast: bool = False,
                 attn_heads: dict[int, tuple[int, int]] | None = None, kv_pool=None, predictor_path: str = "",
                 row_layout: str = "", input_major: str = "", adaptive_spin: bool | None = None,
                 layout_cache: str = "", cold_units: np.ndarray | None = None, n_experts: int = 0,
                 deal: dict[int, tuple[int, int]] | None = None):
        if "coordinator" in [sh.role for sh in plan.shards[:-1]]:  # before anything is allocated
            raise ValueError("a plan has at most one coordinator shard, and it comes last")
        self.model_path = Path(model_path).resolve()
        self.plan = plan
        self.threads = threads_per_worker
        self.gpu_device = gpu_device
        self.weights, self.fast = weights, fast
        self.row_layout = row_layout  # which FFN rows are interleaved (Assign.interleave, ROW_LAYOUTS)
        self.input_major = input_major  # Assign.input_major
        self.layout_cache, self.cold_units = layout_cache, cold_units  # Assign.layout_cache, .cold_units
        self.predictor_path = str(predictor_path or "")  # Assign.predictor_path
        self.startup_timeout_s = startup_timeout_s
        self.launcher = launcher or default_launcher
        self.head_rows = head_rows or {}  # slot -> [start, stop) of the lm_head's vocabulary rows
        self.deal = deal or {}  # slot -> (phase, dealers) of its routed layers' experts (Assign.deal)
        # slot -> [kv0, kv1): KV heads of decoded tokens' attention (sparsecore/attn_shard.py),
        # over the KV caches of kv_pool (sparsecore/kv_pool.py), whose descriptor workers inherit
        self.attn_heads, self.kv_pool = attn_heads or {}, kv_pool
        self.workers: list[WorkerProc] = []
        self.closed = False
        # The handshake's state (spawn, wait_ready): workers not sent their Assign, not yet Ready.
        self._pending_assign: set[bytes] = set()
        self._pending_ready: set[bytes] = set()
        self._early: threading.Thread | None = None  # answers Hellos while the coordinator loads
        self._early_stop = threading.Event()
        self._early_error: BaseException | None = None
        # Worker processes for every shard but a last "coordinator" one, which this process computes.
        self.proc_shards = [sh for sh in plan.shards if sh.role != "coordinator"]
        self.own_slot = len(self.proc_shards) if len(self.proc_shards) < len(plan.shards) else None
        self.run_dir = private_runtime_dir()
        shm_name = new_segment_name()
        # whatever happens to this process from here, the names go (coordinator/runtime/reaper.py)
        self.reaper_fd: int | None = start_reaper(str(self.run_dir), shm_name)
        self.secret, self.secret_path = write_secret(self.run_dir)
        self.authenticated: set[bytes] = set()  # identities whose Hello carried the secret
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_WORKER_MESSAGE)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(worker_endpoint(self.run_dir, transport))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # n_experts: a routed model's per-expert CATS thresholds (SharedBuffers.expert_thresholds)
        layout = ShmLayout(hidden, plan.n_ff, max_tokens, len(plan.shards), plan.n_layers, n_experts)
        self.buffers = SharedBuffers.create(layout, shm_name)
        self.spinning_workers = sum(1 for sh in self.proc_shards if any(len(n) for n in sh.neurons))
        self.spin = choose_spin(self.spinning_workers, cores) if spin is None else spin
        wakes = [WakePipe.create(str(self.run_dir / f"slot{slot}.wake")) for slot in range(len(self.proc_shards))]
        self.bell = CoordinatorBell(self.buffers, WakePipe.create(str(self.run_dir / "coordinator.wake")), wakes,
                                    self.spin, self.sock, self.check_alive, DEATH_CHECK_S, adaptive_spin)

    # ---- startup ------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the worker processes; they import and connect while the coordinator loads. A
        shard with nothing to compute (the GPU worker's on a machine without CUDA) gets no
        process: it would cost a torch import and its memory for nothing."""
        for slot, shard in enumerate(self.proc_shards):
            if not any(len(n) for n in shard.neurons) and slot not in self.head_rows:
                continue
            cmd = self.launcher(shard, self.endpoint)
            fds = (self.kv_pool.fd,) if self.kv_pool is not None and slot in self.attn_heads else ()
            proc = subprocess.Popen(cmd, env=_worker_env(self.threads, self.secret_path), stdin=subprocess.DEVNULL,
                                    pass_fds=fds, **_OWN_GROUP)
            self.workers.append(WorkerProc(shard.role, shard.worker_id, slot, proc,
                                           f"{shard.role}{shard.worker_id}".encode()))
        self._pending_assign = {w.identity for w in self.workers}
        self._pending_ready = set(self._pending_assign)
        if self.workers:
            # Each worker's Assign goes out as soon as its Hello arrives, from a thread that waits
            # in zmq's poll (no GIL held) while this one loads its own share: a worker repacks its
            # rows during that load instead of after it (wait_ready takes over from the thread).
            self._early = threading.Thread(target=self._answer_hellos, name="worker-handshake", daemon=True)
            self._early.start()

    def _answer_hellos(self) -> None:
        try:
            while self._pending_assign and not self._early_stop.is_set():
                self._handshake_step(HANDSHAKE_SLICE_MS)
        except BaseException as e:  # noqa: BLE001 - wait_ready raises it in the caller's thread
            self._early_error = e

    def _stop_early(self) -> None:
        """End the start-up thread; from here only the caller's thread uses the socket."""
        if self._early is not None:
            self._early_stop.set()
            self._early.join()
            self._early = None

    def _assign(self, slot: int) -> Assign:
        shard = self.plan.shards[slot]
        layers = list(range(self.plan.n_layers))
        neurons = [np.asarray(shard.neurons[l], dtype=np.int32).tobytes() for l in layers]
        return Assign(str(self.model_path), self.buffers.name, slot, layers, neurons, self.threads,
                      self.gpu_device if shard.role == "gpu" else "cpu", self.weights,
                      WORKER_SPIN_US if self.spin else 0, self.bell.worker_wakes[slot].path, self.bell.wake.path,
                      list(self.head_rows.get(slot, ())), self.fast, list(self.attn_heads.get(slot, ())),
                      self.kv_pool.fd if self.kv_pool is not None else -1,
                      list(astuple(self.kv_pool.shape)) if self.kv_pool is not None else [], self.predictor_path,
                      self.row_layout, self.input_major, self.layout_cache,
                      b"" if self.cold_units is None else np.ascontiguousarray(self.cold_units, np.uint8).tobytes(),
                      b"" if shard.experts is None else np.ascontiguousarray(shard.experts, np.uint8).tobytes(),
                      list(self.deal.get(slot, ())))

    def wait_ready(self) -> None:
        """Handshake: answer each Hello with an Assign, wait for every Ready (or a failure)."""
        if not self.workers:
            self.spawn()
        self._stop_early()
        if self._early_error is not None:
            raise self._early_error
        deadline = time.monotonic() + self.startup_timeout_s
        while self._pending_ready:
            if time.monotonic() > deadline:
                by_identity = {w.identity: w for w in self.workers}
                names = ", ".join(by_identity[i].label for i in sorted(self._pending_ready))
                raise WorkerError(f"timed out after {self.startup_timeout_s:.0f}s waiting for: {names}")
            self._handshake_step(POLL_SLICE_MS)
        self._remove_names()

    def _handshake_step(self, timeout_ms: int) -> None:
        """Handle one message of the start-up handshake, or check the processes when none comes
        within `timeout_ms`: a Hello gets its Assign, a Ready is noted, a failure raises."""
        got = self._recv(timeout_ms)
        if got is None:
            self._check_processes()
            return
        ident, msg = got
        w = self._by_ident(ident)
        if w is None:
            return
        if isinstance(msg, Hello):
            if not hmac.compare_digest(msg.secret.encode(), self.secret.encode()):
                return  # not our worker (another local process on the tcp port): ignore it
            self.authenticated.add(ident)
            w.pid = msg.pid
            self._send(ident, self._assign(w.slot))
            self._pending_assign.discard(ident)
        elif isinstance(msg, Ready):
            w.n_neurons, w.device, w.weight_bytes, w.predicts, w.lockstep, w.experts = (
                msg.n_neurons, msg.device, msg.weight_bytes, msg.predicts, msg.lockstep, msg.experts)
            self._pending_ready.discard(ident)
        elif isinstance(msg, WorkerFailed):
            raise WorkerError(f"{w.label} failed while loading: {msg.reason}")

    def _remove_names(self) -> None:
        """Every worker has now connected, mapped the segment and opened its wake pipes (it does
        all that before Ready): remove their names at once. Open mappings, descriptors and
        connections keep working, and a kill -9 of any or all processes from here on leaves no
        segment, FIFO, socket or directory behind (no one would be left to remove them)."""
        self.buffers.unlink()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self._release_reaper()

    def _release_reaper(self) -> None:
        """No names left to remove: let the reaper go."""
        if self.reaper_fd is not None:
            os.close(self.reaper_fd)
            self.reaper_fd = None

    # ---- liveness -----------------------------------------------------------------------

    def check_alive(self) -> None:
        """Raise WorkerError naming the worker if one reported a failure or died."""
        while True:
            got = self._recv(0)
            if got is None:
                break
            ident, msg = got
            if isinstance(msg, WorkerFailed):
                w = self._by_ident(ident)
                raise WorkerError(f"{w.label if w else repr(ident)} failed: {msg.reason}")
        self._check_processes()

    def _check_processes(self) -> None:
        for w in self.workers:
            if w.proc.poll() is not None:
                raise WorkerError(f"{w.label} died: {w.exit_reason()}")

    # ---- plumbing -----------------------------------------------------------------------

    def _by_ident(self, ident: bytes) -> WorkerProc | None:
        return next((w for w in self.workers if w.identity == ident), None)

    def _send(self, ident: bytes, msg) -> None:
        try:
            self.sock.send_multipart([ident, encode(msg)])
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
            self._check_processes()
            raise WorkerError(f"cannot reach {self._by_ident(ident).label}: {e}") from None

    def _recv(self, timeout_ms: int):
        """(identity, message) or None. Until a peer's Hello carried the run's secret, only its
        Hello is passed on and anything else from it is dropped (with tcp, any local process can
        connect). A malformed message from an authenticated worker ends the run naming it: our
        workers never send one, so it has gone wrong."""
        while self.sock.poll(timeout_ms):
            frames = self.sock.recv_multipart()
            ident = frames[0]
            trusted = ident in self.authenticated
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"{len(frames) - 1} frames instead of 1")
                msg = decode(frames[1])
            except ProtocolError as e:
                if trusted:
                    w = self._by_ident(ident)
                    raise WorkerError(f"{w.label if w else repr(ident)} sent a malformed message: {e}") from None
                continue
            if trusted or isinstance(msg, Hello):
                return ident, msg
        return None

    def close(self) -> None:
        """Stop every worker (politely, then by force), unlink shared memory, remove sockets."""
        if self.closed:
            return
        self.closed = True
        self._stop_early()
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
        self.bell.close()
        self.buffers.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self._release_reaper()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
