"""Start the worker processes, run the per-layer FFN exchange with them, stop them cleanly.

Per layer: the caller has written x (and the active mask) into shared memory; run_ffn rings the
doorbell (the request words in shared memory, and the wake pipe of each worker that sleeps),
waits until every worker that owns neurons of the layer reports the step done (its doorbell
slot), and sums their output slots. When there are cores for it, both sides spin on shared
memory for a while before they sleep on their wake pipes (sparsecore/doorbell.py says why).
While waiting, the pool checks each process, so a dead worker is reported by name within a
fraction of a second instead of hanging the token loop. A worker without a wake pipe (the test
suite's mock workers) gets Ffn messages and answers with Done messages instead.

A plan may end with a "coordinator" shard: neurons the coordinator computes itself, between
ringing the workers and waiting for them, into its own output slot. On a CPU-only machine the
coordinator's core would otherwise only wait during the FFN, so the layer's FFN is split over
every core instead of running on the workers' alone.
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
from protocol.shm_layout import (FLAG_DENSE, FLAG_THRESHOLD, HEAD_LAYER, REQ_COORD_SLEEPING, REQ_FLAGS, REQ_LAYER,
                                 REQ_STEP, REQ_TOKENS, SLEEP_ON_PIPE, SLOT_ACTIVE,
                                 SLOT_COMPUTE_NS, SLOT_DONE, SLOT_SLEEPING, SharedBuffers, ShmLayout)
from sparsecore.doorbell import (COORDINATOR_SPIN_US, SOCKET_CHECK_SPINS, WORKER_SPIN_US, WakePipe,
                                 spin_supported, usable_cores)

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
    head_us: list[float] = field(default_factory=list)  # lm_head steps split across processes
    wakeups: int = 0  # steps posted to sleeping workers (by wake pipe or Ffn message)
    ffn_messages: int = 0  # of those, sent as Ffn messages (workers without a wake pipe)


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
                 startup_timeout_s: float = 120.0, launcher: Launcher | None = None, weights: str = "f32",
                 spin: bool | None = None, cores: int | None = None, split_lm_head: bool = False):
        if "coordinator" in [sh.role for sh in plan.shards[:-1]]:  # before anything is allocated
            raise ValueError("a plan has at most one coordinator shard, and it comes last")
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
        self._last_alive_check = 0.0
        self.run_dir = private_runtime_dir()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(worker_endpoint(self.run_dir, transport))
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Worker processes for every shard but a last "coordinator" one, which this process computes.
        self.proc_shards = [sh for sh in plan.shards if sh.role != "coordinator"]
        self.local_slot = len(self.proc_shards) if len(self.proc_shards) < len(plan.shards) else None
        self.local_layers: dict = {}  # layer -> LayerWeights of the coordinator's own neurons
        self.local_weight_bytes = 0
        # With a coordinator shard the lm_head's vocabulary rows may be split too: each worker
        # that computes FFN neurons and the coordinator take rows in proportion to their neurons.
        self.split_lm_head = split_lm_head
        self.head_rows: dict[int, tuple[int, int]] = {}  # worker slot -> [start, stop)
        self.head_participants = np.array([], dtype=np.intp)
        self.local_head = None  # the coordinator's rows, the last ones (sparsecore.lm_head.HeadRows)
        layout = ShmLayout(hidden, plan.n_ff, max_tokens, len(plan.shards), plan.n_layers)
        self.buffers = SharedBuffers.create(layout)
        self.closed = False
        self.wake = WakePipe.create(str(self.run_dir / "coordinator.wake"))
        self.worker_wakes = [WakePipe.create(str(self.run_dir / f"slot{slot}.wake"))
                             for slot in range(len(self.proc_shards))]
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.wake.fileno(), zmq.POLLIN)
        # Per layer, the slots of the workers that own neurons of it: only they get the step.
        self.participants = [np.array([slot for slot, sh in enumerate(self.proc_shards) if len(sh.neurons[layer])],
                                      dtype=np.intp) for layer in range(plan.n_layers)]
        # ... and the slots whose outputs are summed: theirs and, where it has neurons, ours.
        local = plan.shards[self.local_slot] if self.local_slot is not None else None
        self.sum_slots = [p if local is None or not len(local.neurons[layer]) else np.append(p, self.local_slot)
                          for layer, p in enumerate(self.participants)]
        # Spin only when the coordinator and every worker that computes have a core each: a
        # spinner sharing a core with the process it waits for delays it by a scheduler tick.
        self.spinning_workers = sum(1 for sh in self.proc_shards if any(len(n) for n in sh.neurons))
        if spin is None:
            spin = spin_supported() and 1 + self.spinning_workers <= (cores or usable_cores())
        self.spin = spin
        if not self.spin:  # the coordinator always sleeps: workers always ring its wake pipe
            self.buffers.request[REQ_COORD_SLEEPING] = SLEEP_ON_PIPE

    # ---- startup ------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the worker processes; they import and connect while the coordinator loads."""
        for shard in self.proc_shards:
            cmd = self.launcher(shard, self.endpoint)
            proc = subprocess.Popen(cmd, env=_worker_env(self.threads), stdin=subprocess.DEVNULL, **_OWN_GROUP)
            self.workers.append(WorkerProc(shard.role, shard.worker_id, proc, f"{shard.role}{shard.worker_id}".encode()))
        self._slot_of = {w.identity: slot for slot, w in enumerate(self.workers)}

    def wait_ready(self) -> None:
        """Handshake: answer each Hello with an Assign, wait for every Ready (or a failure)."""
        if not self.workers:
            self.spawn()
        self._load_local()  # while the workers start up
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
                                         self.threads, dev, self.weights,
                                         WORKER_SPIN_US if self.spin else 0,
                                         self.worker_wakes[slot].path, self.wake.path,
                                         list(self.head_rows.get(slot, ()))))
            elif isinstance(msg, Ready):
                w.n_neurons, w.device, w.weight_bytes = msg.n_neurons, msg.device, msg.weight_bytes
                pending_ready.discard(ident)
            elif isinstance(msg, WorkerFailed):
                raise WorkerError(f"{w.label} failed while loading: {msg.reason}")

    def _load_local(self) -> None:
        """The coordinator shard's rows, read from the model file like a worker reads its own."""
        if self.local_slot is None or self.local_layers:
            return
        import torch

        from sparsecore.config import read_config
        from sparsecore.gguf_file import open_gguf
        from sparsecore.tensors import TensorStore
        from sparsecore.worker_runtime import LayerWeights, compute_step

        self._compute_step = compute_step  # imported here: the pool module stays free of torch
        self.local_device = torch.device("cpu")
        reader = open_gguf(self.model_path)
        cfg = read_config(self.model_path, reader)
        self.local_activation = cfg.activation
        store = TensorStore(self.model_path, reader)
        shard = self.plan.shards[self.local_slot]
        for layer in range(self.plan.n_layers):
            idx = np.asarray(shard.neurons[layer], dtype=np.int64)
            if len(idx):
                self.local_layers[layer] = LayerWeights(store, layer, idx, torch.device("cpu"), self.weights)
        self.local_weight_bytes = sum(w.nbytes for w in self.local_layers.values())
        if self.split_lm_head:
            self._split_head(store, cfg.tied_embeddings)

    def _split_head(self, store, tied: bool) -> None:
        """Vocabulary rows per process, in proportion to the FFN neurons each computes; none
        when a worker's rows would not fit its output slot (then the coordinator keeps them all)."""
        from sparsecore.lm_head import HeadRows, head_tensor_name

        name = head_tensor_name(tied)
        n_vocab = store.shape(name)[0]
        slots = [slot for slot, sh in enumerate(self.proc_shards) if any(len(n) for n in sh.neurons)]
        slots.append(self.local_slot)
        load = np.array([sum(len(n) for n in self.plan.shards[slot].neurons) for slot in slots], dtype=np.float64)
        cuts = np.concatenate([[0], np.round(np.cumsum(load) / load.sum() * n_vocab)]).astype(int)
        capacity = self.buffers.layout.max_tokens * self.buffers.layout.hidden
        if len(slots) < 2 or np.diff(cuts).max() > capacity:
            return
        self.head_rows = {slot: (int(cuts[i]), int(cuts[i + 1])) for i, slot in enumerate(slots[:-1])}
        self.head_participants = np.array(slots[:-1], dtype=np.intp)
        self.local_head = HeadRows(store, name, int(cuts[-2]), n_vocab)

    @property
    def local_neuron_share(self) -> float:
        """The fraction of all FFN neurons (every layer) the coordinator computes itself."""
        if self.local_slot is None:
            return 0.0
        own = sum(len(n) for n in self.plan.shards[self.local_slot].neurons)
        return own / (self.plan.n_layers * self.plan.n_ff)

    # ---- per-layer exchange -------------------------------------------------------------

    def run_ffn(self, layer: int, n_tokens: int, dense: bool = True, threshold: bool = False) -> np.ndarray:
        """Ask every worker that owns neurons of `layer` for its partial FFN; return the sum, shape
        (n_tokens, hidden). The (neuron, token) pairs computed are added to self.stats.active[layer]."""
        if not 1 <= n_tokens <= self.buffers.layout.max_tokens:
            raise ValueError(f"n_tokens {n_tokens} outside 1..{self.buffers.layout.max_tokens}")
        self.step += 1
        step = self.step
        t0 = time.perf_counter()
        buf = self.buffers
        part = self.participants[layer]
        self._post(step, layer, n_tokens, dense, threshold, part)
        local = self.local_layers.get(layer)
        if local is not None:  # our own neurons while the workers compute theirs
            n_local, local_ns = self._compute_step(local, buf, self.local_slot, layer, n_tokens, dense, threshold,
                                                   self.local_activation, self.local_device)
        n_active, slowest_ns = self._wait_done(step, part)
        if local is not None:
            n_active += n_local
            slowest_ns = max(slowest_ns, local_ns)
        self.stats.active[layer] = self.stats.active.get(layer, 0) + n_active
        self.stats.tokens[layer] = self.stats.tokens.get(layer, 0) + n_tokens
        rt = (time.perf_counter() - t0) * 1e6
        self.stats.round_trip_us.append(rt)
        self.stats.overhead_us.append(rt - slowest_ns / 1e3)
        summed = self.sum_slots[layer]
        if len(summed) == 1:
            return buf.out[summed[0], :n_tokens].copy()
        if len(summed) == 2:  # one worker and the coordinator: the common CPU-only case
            return np.add(buf.out[summed[0], :n_tokens], buf.out[summed[1], :n_tokens])
        if len(summed) == len(self.plan.shards):
            return buf.out[:, :n_tokens].sum(axis=0)
        return buf.out[summed, :n_tokens].sum(axis=0)

    def run_lm_head(self, x: np.ndarray) -> np.ndarray:
        """Logits (n_vocab,) for one final normed hidden state x (hidden,): each worker in
        head_rows computes its vocabulary rows while the coordinator computes the last ones."""
        self.step += 1
        step = self.step
        t0 = time.perf_counter()
        buf = self.buffers
        buf.x[0] = x
        part = self.head_participants
        self._post(step, HEAD_LAYER, 1, True, False, part)
        logits = np.empty(self.local_head.stop, np.float32)  # the coordinator's rows end the vocabulary
        logits[self.local_head.start:] = self.local_head(buf.x[:1])
        self._wait_done(step, part)
        for slot in part:
            a, b = self.head_rows[int(slot)]
            logits[a:b] = buf.out[slot].reshape(-1)[: b - a]
        self.stats.head_us.append((time.perf_counter() - t0) * 1e6)
        return logits

    def _post(self, step: int, layer: int, n_tokens: int, dense: bool, threshold: bool, part: np.ndarray) -> None:
        """Publish step `step` in the shared request words, then wake the slots in `part` that sleep."""
        req, slots = self.buffers.request, self.buffers.slots
        req[REQ_LAYER], req[REQ_TOKENS] = layer, n_tokens
        req[REQ_FLAGS] = (FLAG_DENSE if dense else 0) | (FLAG_THRESHOLD if threshold else 0)
        req[REQ_STEP] = step  # last: a spinning worker that sees it reads a complete request
        for slot in part:
            sleeping = slots[slot, SLOT_SLEEPING]
            if sleeping:
                self.stats.wakeups += 1
                if sleeping == SLEEP_ON_PIPE:
                    self.worker_wakes[slot].ring()
                else:
                    self._send(self.workers[slot].identity, Ffn(layer, step, n_tokens, dense, threshold))
                    self.stats.ffn_messages += 1

    def _wait_done(self, step: int, part: np.ndarray) -> tuple[int, int]:
        """Wait until every slot in `part` has done `step`: spin on the doorbell, then sleep on the
        socket. Returns (active pairs summed, slowest compute in ns). A slot counts once, whether
        its doorbell or a Done message (or both) says so; a stale or duplicate Done is ignored."""
        slots = self.buffers.slots
        waiting = set(int(s) for s in part)
        n_active, slowest = 0, 0

        def take(slot: int, active: int, compute_ns: int) -> None:
            nonlocal n_active, slowest
            waiting.discard(slot)
            n_active += active
            slowest = max(slowest, compute_ns)

        def check_doorbell() -> None:
            for slot in [s for s in waiting if slots[s, SLOT_DONE] == step]:
                take(slot, int(slots[slot, SLOT_ACTIVE]), int(slots[slot, SLOT_COMPUTE_NS]))

        def handle(got) -> None:
            ident, msg = got
            if isinstance(msg, WorkerFailed):
                raise WorkerError(f"{self._by_ident(ident).label} failed: {msg.reason}")
            if isinstance(msg, Done) and msg.step == step:
                slot = self._slot_of[ident]
                if slot in waiting:
                    take(slot, msg.n_active, int(msg.compute_us * 1e3))

        self._check_alive_every(DEATH_CHECK_S)  # also workers that sit this layer out
        deadline = time.monotonic() + (COORDINATOR_SPIN_US / 1e6 if self.spin else 0.0)
        n = 0
        while waiting and self.spin:
            check_doorbell()
            n += 1
            if waiting and n % SOCKET_CHECK_SPINS == 0:
                if self.sock.poll(0):
                    handle(self._recv(0))
                self._check_alive_every(DEATH_CHECK_S)
                if time.monotonic() > deadline:
                    break
        if not waiting:
            return n_active, slowest
        # Sleep on the wake pipe and the socket; workers that see the flag ring the pipe (mock
        # workers send Done). The first waits are short in case a worker finished just as the
        # flag went up (its store and our load may pass each other).
        req = self.buffers.request
        req[REQ_COORD_SLEEPING] = SLEEP_ON_PIPE
        try:
            timeout = 1
            while True:
                check_doorbell()
                if not waiting:
                    # Done messages whose doorbell answered first are still queued: read them
                    # now, or they pile up until the workers' sends block at the high-water mark.
                    while self.sock.poll(0):
                        handle(self._recv(0))
                    return n_active, slowest
                ready = dict(self._poller.poll(timeout))
                if self.wake.fileno() in ready:
                    self.wake.drain()
                if self.sock in ready:
                    handle(self._recv(0))
                self._check_alive_every(0.0 if not ready else DEATH_CHECK_S)
                timeout = min(POLL_SLICE_MS, timeout * 4)
        finally:
            if self.spin:
                req[REQ_COORD_SLEEPING] = 0

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

    def _check_alive_every(self, interval_s: float) -> None:
        """_check_alive, at most once per `interval_s` across exchanges (one is far shorter)."""
        now = time.monotonic()
        if now - self._last_alive_check >= interval_s:
            self._check_alive()
            self._last_alive_check = now

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
        for pipe in (self.wake, *self.worker_wakes):
            pipe.close()
        self.buffers.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
