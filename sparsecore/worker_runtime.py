"""The serve loop both worker kinds run: handshake, load owned neuron rows, answer "ffn" steps.

A worker is started by the coordinator with an endpoint and an id. It says Hello, receives an
Assign (model file, shared-memory name, its neuron indices per layer), memory-maps the model
and slices its rows, says Ready, then for every step computes its partial FFN from shared
memory into its own output slot and reports it done. It never receives weights over the wire.

Steps arrive through the shared-memory doorbell: the worker spins on it for Assign.spin_us
after its last step, then sleeps on its wake pipe until the coordinator rings it; see
protocol/shm_layout.py and sparsecore/doorbell.py.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import numpy as np
import torch
import zmq

from protocol.addresses import COORDINATOR_PID_ENV
from protocol.messages import Assign, Done, Ffn, Hello, Ready, Shutdown, WorkerFailed, decode, encode
from protocol.shm_layout import (FLAG_DENSE, FLAG_THRESHOLD, HEAD_LAYER, REQ_COORD_SLEEPING, REQ_FLAGS, REQ_LAYER,
                                 REQ_STEP, REQ_TOKENS, SLEEP_ON_PIPE, SLEEP_ON_SOCKET, SLOT_ACTIVE,
                                 SLOT_COMPUTE_NS, SLOT_DONE, SLOT_SLEEPING, SharedBuffers)

from .config import read_config
from .doorbell import SOCKET_CHECK_SPINS, WakePipe
from .ffn import ffn_partial, ffn_partial_threshold, quantize_rows, rows_nbytes
from .gguf_file import open_gguf
from .lm_head import HeadRows, head_tensor_name
from .tensors import TensorStore

PARENT_CHECK_MS = 500  # how often an idle worker checks that its coordinator still exists


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the coordinator dies, so a crash orphans no worker."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _coordinator_pid() -> int | None:
    try:
        return int(os.environ[COORDINATOR_PID_ENV])
    except (KeyError, ValueError):
        return None


def _process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (exited, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


class LayerWeights:
    """One layer's owned neurons: gate/up rows and down columns (as rows) on the device, in the
    weight format `weights` (sparsecore.ffn.WEIGHT_FORMATS): float32, or int8 or float16 rows
    converted once here from the file's dequantized values."""

    def __init__(self, store: TensorStore, layer: int, idx: np.ndarray, device: torch.device,
                 weights: str = "f32"):
        self.idx = idx
        p = f"blk.{layer}."
        dev = lambda a, down=False: quantize_rows(torch.from_numpy(np.ascontiguousarray(a)).to(device),
                                                  weights, for_h_w=down)
        self.gate = dev(store.rows(p + "ffn_gate.weight", idx))
        self.up = dev(store.rows(p + "ffn_up.weight", idx))
        if store.has(p + "ffn_down_t.weight"):  # PowerInfer stores down transposed: rows are neurons
            self.down_t = dev(store.rows(p + "ffn_down_t.weight", idx), down=True)
        else:
            self.down_t = dev(store.columns(p + "ffn_down.weight", idx), down=True)

    @property
    def nbytes(self) -> int:
        return sum(rows_nbytes(w) for w in (self.gate, self.up, self.down_t))


def compute_step(w: LayerWeights, buf: SharedBuffers, slot: int, layer: int, n_tokens: int, dense: bool,
                 threshold: bool, activation: str, device: torch.device) -> tuple[int, int]:
    """One FFN step over the neurons of `w`: x, the mask and the thresholds from shared memory,
    the partial output into `slot`. Returns (active neuron-token pairs, ns taken). Workers run
    it per step; so does the coordinator for the share of neurons it computes itself."""
    t0 = time.perf_counter()
    x = torch.from_numpy(buf.x[:n_tokens]).to(device)
    if threshold:
        y, n_active = ffn_partial_threshold(x, w.gate, w.up, w.down_t, activation, float(buf.thresholds[layer]))
    else:
        active = None
        if not dense:
            active = torch.from_numpy(np.flatnonzero(buf.mask[w.idx])).to(device)
        y = ffn_partial(x, w.gate, w.up, w.down_t, activation, active)
        n_active = len(w.idx) * n_tokens if active is None else int(active.numel()) * n_tokens
    buf.out[slot, :n_tokens] = y.cpu().numpy()
    return n_active, int((time.perf_counter() - t0) * 1e9)


def head_step(head: HeadRows, buf: SharedBuffers, slot: int) -> tuple[int, int]:
    """One lm_head step: the logits of `head`'s vocabulary rows for x[0], written flat into the
    start of `slot`. Returns (0 neurons, ns taken), like compute_step."""
    t0 = time.perf_counter()
    logits = head(buf.x[:1])
    buf.out[slot].reshape(-1)[: len(logits)] = logits
    return 0, int((time.perf_counter() - t0) * 1e9)


def pick_device(role: str, requested: str) -> torch.device:
    if requested not in ("auto", ""):
        return torch.device(requested)
    if role == "gpu" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


class Worker:
    def __init__(self, endpoint: str, worker_id: int, role: str):
        self.worker_id, self.role = worker_id, role
        self.ppid = os.getppid()
        # If the coordinator died while we were still importing, we were re-parented before
        # recording ppid and PR_SET_PDEATHSIG came too late: check the coordinator's pid too.
        self.coordinator_pid = _coordinator_pid()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{role}{worker_id}".encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(endpoint)
        self.layers: dict[int, LayerWeights] = {}
        self.head: HeadRows | None = None  # our vocabulary rows of the lm_head, if we have any
        self.buffers: SharedBuffers | None = None
        self.activation = "silu"
        self.last_step = 0
        self.spin_s = 0.0
        self.wake: WakePipe | None = None  # ours: the coordinator rings it while we sleep
        self.coordinator_wake: WakePipe | None = None  # the coordinator's: rung when a step is done
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def recv(self):
        """Next message, or None when the coordinator has gone away."""
        while not self.sock.poll(PARENT_CHECK_MS):
            if self.coordinator_gone():
                return None
        return decode(self.sock.recv())

    def coordinator_gone(self) -> bool:
        if os.getppid() != self.ppid:
            return True
        return self.coordinator_pid is not None and _process_gone(self.coordinator_pid)

    def load(self, a: Assign) -> None:
        torch.set_num_threads(max(1, a.threads))
        self.device = pick_device(self.role, a.device)
        reader = open_gguf(a.model_path)
        cfg = read_config(a.model_path, reader)
        self.activation = cfg.activation
        store = TensorStore(a.model_path, reader)
        for layer, raw in zip(a.layers, a.neurons):
            idx = np.frombuffer(raw, dtype=np.int32).astype(np.int64)
            self.layers[layer] = LayerWeights(store, layer, idx, self.device, a.weights)
        if a.head_rows:
            self.head = HeadRows(store, head_tensor_name(cfg.tied_embeddings), *a.head_rows)
        self.buffers = SharedBuffers.attach(a.shm_name)
        self.slot = a.slot
        # A worker that owns no neuron (the GPU worker on a machine without one, by default)
        # is never asked for a step: it sleeps instead of spinning on a core others compute on.
        owns = any(len(w.idx) for w in self.layers.values())
        self.spin_s = a.spin_us / 1e6 if owns else 0.0
        if a.wake_pipe and a.coordinator_pipe:
            self.wake, self.coordinator_wake = WakePipe(a.wake_pipe), WakePipe(a.coordinator_pipe)
            self.poller.register(self.wake.fileno(), zmq.POLLIN)

    # ---- receiving steps ------------------------------------------------------------------

    def _doorbell_request(self) -> Ffn | None:
        """The shared-memory request if it is a new step for this worker, else None. Read like a
        seqlock: the step before and after the fields must agree."""
        req = self.buffers.request
        while True:
            step = int(req[REQ_STEP])
            if step == self.last_step:
                return None
            layer, n_tokens, flags = int(req[REQ_LAYER]), int(req[REQ_TOKENS]), int(req[REQ_FLAGS])
            if int(req[REQ_STEP]) == step:
                break
        if layer == HEAD_LAYER:
            w = self.head
        else:
            w = self.layers.get(layer)
            w = None if w is None or len(w.idx) == 0 else w
        if w is None:  # not a participant: the coordinator does not wait for us
            self.last_step = step
            return None
        return Ffn(layer, step, n_tokens, bool(flags & FLAG_DENSE), bool(flags & FLAG_THRESHOLD))

    def _from_socket(self, msg):
        """A message from the socket: Shutdown, a new Ffn, or None (a wake-up for a step we
        already took from the doorbell, or anything else stale)."""
        if isinstance(msg, Shutdown):
            return msg
        if isinstance(msg, Ffn) and msg.step > self.last_step:
            return msg
        return None

    def next_step(self):
        """The next Ffn for this worker, Shutdown, or None when the coordinator has gone away."""
        req = self.buffers.request
        if self.spin_s > 0:
            deadline = time.perf_counter() + self.spin_s
            n = 0
            while True:
                if req[REQ_STEP] != self.last_step:
                    m = self._doorbell_request()
                    if m is not None:
                        return m
                n += 1
                if n % SOCKET_CHECK_SPINS == 0:
                    if self.sock.poll(0):
                        m = self._from_socket(decode(self.sock.recv()))
                        if m is not None:
                            return m
                    if time.perf_counter() > deadline:
                        break
        # Sleep on the wake pipe and the socket. The flag goes up before the doorbell is checked
        # once more, so a step posted meanwhile is either seen here or followed by a ring; the
        # first waits are short in case both looked at once (store-load reordering).
        slot = self.buffers.slots[self.slot]
        slot[SLOT_SLEEPING] = SLEEP_ON_PIPE if self.wake is not None else SLEEP_ON_SOCKET
        try:
            timeout = 1
            while True:
                m = self._doorbell_request()
                if m is not None:
                    return m
                ready = dict(self.poller.poll(timeout))
                if self.wake is not None and self.wake.fileno() in ready:
                    self.wake.drain()
                if self.sock in ready:
                    m = self._from_socket(decode(self.sock.recv()))
                    if m is not None:
                        return m
                elif not ready and self.coordinator_gone():
                    return None
                timeout = min(PARENT_CHECK_MS, timeout * 4)
        finally:
            slot[SLOT_SLEEPING] = 0

    def finish(self, m: Ffn, n_active: int, compute_ns: int) -> None:
        """Report step `m` done: the doorbell slot always, a ring (or Done) if the coordinator sleeps."""
        slot = self.buffers.slots[self.slot]
        slot[SLOT_ACTIVE] = n_active
        slot[SLOT_COMPUTE_NS] = compute_ns
        slot[SLOT_DONE] = m.step
        self.last_step = m.step
        sleeping = self.buffers.request[REQ_COORD_SLEEPING]
        if sleeping == SLEEP_ON_PIPE and self.coordinator_wake is not None:
            self.coordinator_wake.ring()
        elif sleeping:
            self.send(Done(self.worker_id, m.layer, m.step, compute_ns / 1e3, n_active))

    def step(self, m: Ffn) -> tuple[int, int]:
        """Compute step `m` into this worker's output slot: (active neuron-token pairs, ns taken)."""
        if m.layer == HEAD_LAYER:
            return head_step(self.head, self.buffers, self.slot)
        return compute_step(self.layers[m.layer], self.buffers, self.slot, m.layer, m.n_tokens, m.dense,
                            m.threshold, self.activation, self.device)

    def serve(self) -> int:
        self.send(Hello(self.worker_id, self.role, os.getpid()))
        assign = self.recv()
        if not isinstance(assign, Assign):
            return 1
        t0 = time.perf_counter()
        try:
            self.load(assign)
        except Exception as e:  # report why, then exit: the coordinator names us in its error
            self.send(WorkerFailed(self.worker_id, self.role, f"{type(e).__name__}: {e}"))
            return 1
        n = sum(len(w.idx) for w in self.layers.values())
        nbytes = sum(w.nbytes for w in self.layers.values())
        self.send(Ready(self.worker_id, self.role, os.getpid(), n, str(self.device), time.perf_counter() - t0, nbytes))
        while True:
            m = self.next_step()
            if m is None or isinstance(m, Shutdown):
                return 0
            if isinstance(m, Ffn):
                try:
                    self.finish(m, *self.step(m))
                except Exception as e:
                    self.send(WorkerFailed(self.worker_id, self.role, f"layer {m.layer}: {type(e).__name__}: {e}"))
                    return 1

    def close(self) -> None:
        if self.buffers is not None:
            self.buffers.close()
        for pipe in (self.wake, self.coordinator_wake):
            if pipe is not None:
                pipe.close()
        self.sock.close()
        self.ctx.term()


def main(role: str, argv: list[str] | None = None) -> int:
    """A worker process's entry point. It ends the process itself once the serve loop is over
    (see the end), so call it only as the whole program of a worker process."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"{role}_worker")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--worker-id", type=int, required=True)
    args = ap.parse_args(argv)
    # Ctrl-C goes to the whole process group; the coordinator decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    coordinator = _coordinator_pid()
    if coordinator is not None and _process_gone(coordinator):
        return 1  # it died before PR_SET_PDEATHSIG was in place: nobody is waiting for us
    w = Worker(args.endpoint, args.worker_id, role)
    try:
        rc = w.serve()
    finally:
        w.close()
    # Sockets and shared memory are closed; skip the interpreter's teardown, which with torch
    # loaded takes from 0.3 s to well over a second on a busy machine and holds up the
    # coordinator's shutdown (multiprocessing's children end with os._exit the same way).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
