"""A worker's logic: handshake, load its FfnShard, then wait for each step, compute it, finish.

The coordinator starts a worker with an endpoint and an id. The worker says Hello, receives an
Assign (model file, shared-memory name, its neuron indices per layer, wake pipes), memory-maps
the model and keeps only its rows (sparsecore/shard.py), says Ready, then serves steps posted
through the doorbell (protocol/doorbell.py) until Shutdown or until its coordinator is gone.
It never receives weights over the wire. The GPU worker runs this same class on a CUDA device
(gpu_worker/worker.py picks it); the process around it is __main__.py.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import zmq

from protocol.addresses import read_secret
from protocol.doorbell import GONE, MESSAGE, WakePipe, WorkerBell
from protocol.messages import Assign, Hello, ProtocolError, Ready, Shutdown, WorkerFailed, decode, encode
from protocol.shm_layout import REQ_STEP, SharedBuffers, StepKind
from sparsecore.attn_shard import AttnShard
from sparsecore.config import read_config
from sparsecore.gguf_file import open_gguf, release_header
from sparsecore.input_sparsity import attach as attach_twins
from sparsecore.kernels import layout_cache
from sparsecore.kv_pool import KvPool, KvShape
from sparsecore.lifeline import Lifeline
from sparsecore.lockstep import Abandoned, Lockstep
from sparsecore.experts import ExpertsLayer
from sparsecore.file_layer import FileLayer
from sparsecore.shard import FfnShard
from sparsecore.tensors import TensorStore

IDLE_CHECK_MS = 500  # how often an idle worker checks that its coordinator still exists


def cpu_device(requested: str) -> str:
    """A CPU worker computes on the CPU whatever it is told, unless told a device explicitly."""
    return "cpu" if requested in ("auto", "") else requested


class Worker:
    def __init__(self, endpoint: str, worker_id: int, role: str = "cpu",
                 pick_device: Callable[[str], object] = cpu_device):
        self.worker_id, self.role, self.pick_device = worker_id, role, pick_device
        self.lifeline = Lifeline()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{role}{worker_id}".encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(endpoint)
        self.shard: FfnShard | None = None
        self.attn: AttnShard | None = None  # query heads of decoded tokens' attention, if assigned
        self.pool: KvPool | None = None
        self.buffers: SharedBuffers | None = None
        self.bell: WorkerBell | None = None
        self.lockstep: Lockstep | None = None  # its part of whole decode steps, where it can take one
        self.experts_held = b""  # a routed model's experts it holds rows of (Ready.experts)

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def recv(self):
        """Next message, or None when the coordinator has gone away."""
        while not self.sock.poll(IDLE_CHECK_MS):
            if self.lifeline.gone():
                return None
        return decode(self.sock.recv())

    def load(self, a: Assign) -> None:
        device = self.pick_device(a.device)
        # torch only for float copies of the rows (other weight formats, a GPU): a worker that
        # computes on the file's blocks never imports it (sparsecore/shard.py)
        if a.weights != "gguf" or str(device) != "cpu":
            import torch

            torch.set_num_threads(max(1, a.threads))
        neurons = [np.frombuffer(raw, dtype=np.int32) for raw in a.neurons]
        store = TensorStore(a.model_path, open_gguf(a.model_path, vocabulary=False))  # it tokenizes nothing
        with layout_cache.using(layout_cache.level_directory(a.layout_cache, a.model_path),
                                copy_held=bool(a.cold_units)):
            self._load_weights(a, neurons, device, store)
        release_header(store.reader)  # loaded: the header's pages need not stay resident here
        self.slot = a.slot
        # A worker that owns no neuron (the GPU worker on a machine without one, by default)
        # is never asked for a step: it sleeps instead of spinning on a core others compute on.
        spin_s = a.spin_us / 1e6 if self.shard.layers else 0.0
        self.bell = WorkerBell(self.buffers, a.slot, WakePipe(a.wake_pipe), WakePipe(a.coordinator_pipe), spin_s,
                               self.sock, self.takes_part, self.lifeline.gone, IDLE_CHECK_MS)

    def _load_weights(self, a: Assign, neurons: list, device, store: TensorStore) -> None:
        """load's weights, each conversion from (or into) the model's layout cache: the FFN shard,
        the attention's heads and the twins."""
        cold = np.frombuffer(a.cold_units, np.uint8).reshape(len(neurons), -1) if a.cold_units else None
        experts = np.frombuffer(a.experts, np.uint8).reshape(len(neurons), -1).astype(bool) if a.experts else None
        self.shard = FfnShard.load(a.model_path, neurons, device, a.weights, tuple(a.head_rows) or None, store,
                                   a.fast, a.predictor_path or None, a.interleave, cold, experts,
                                   tuple(a.deal) or None)
        self.buffers = SharedBuffers.attach(a.shm_name)
        layout = self.buffers.layout
        if layout.n_experts:  # a routed model: count the chosen experts computed here where the coordinator reads them
            self.shard.count_routes_into(self.buffers.route_counts[a.slot])
            self.experts_held = self.shard.experts_held(layout.n_layers, layout.n_experts).tobytes()
        if a.attn_heads:
            self.pool = KvPool.attach(KvShape(*a.kv_shape), a.kv_fd)
            cfg = read_config(a.model_path, store.reader)
            self.attn = AttnShard.load(store, cfg, self.pool, (a.attn_heads[0], a.attn_heads[1]), a.fast)
            self.lockstep = Lockstep.build(self.buffers, a.slot, self.attn.steps, (self.attn.h0, self.attn.h1),
                                           self.shard, store, cfg)
        if a.input_major:  # after the attention's share is kept: its twins are the share's
            layers = {i: w for i, w in self.shard.layers.items() if isinstance(w, (FileLayer, ExpertsLayer))}
            attach_twins(self.buffers.input_thresholds, a.input_major, layers,
                         self.attn.steps if self.attn is not None else None, self.shard.head,
                         self.buffers.head_threshold)

    def takes_part(self, kind: StepKind, layer: int) -> bool:
        if kind is StepKind.LOCKSTEP:
            return self.lockstep is not None
        if kind is StepKind.ATTENTION:
            return self.attn is not None
        return self.shard.takes_part(kind, layer)

    def serve(self) -> int:
        """The worker's whole life after connecting; returns the process's exit code."""
        self.send(Hello(self.worker_id, self.role, os.getpid(), read_secret()))
        assign = self.recv()
        if not isinstance(assign, Assign):
            return 1
        t0 = time.perf_counter()
        try:
            self.load(assign)
        except Exception as e:  # report why, then exit: the coordinator names us in its error
            self.send(WorkerFailed(self.worker_id, self.role, f"{type(e).__name__}: {e}"))
            return 1
        self.send(Ready(self.worker_id, self.role, os.getpid(), self.shard.n_neurons, str(self.shard.device),
                        time.perf_counter() - t0, self.shard.nbytes, self.shard.predicts, self.lockstep is not None,
                        self.experts_held))
        while True:
            req = self.bell.wait()
            if req is GONE:
                return 0
            if req is MESSAGE:
                try:
                    msg = decode(self.sock.recv())
                except ProtocolError:
                    continue  # nothing but Shutdown is expected here; ignore anything else
                if isinstance(msg, Shutdown):
                    return 0
                continue
            try:
                if req.kind is StepKind.LOCKSTEP:
                    n_active, ns = self.lockstep.serve(req, self.pool, self._abandon_check(req.step))
                elif req.kind is StepKind.ATTENTION:
                    n_active, ns = self.attn.serve(self.buffers, self.slot, req)
                else:
                    n_active, ns = self.shard.serve(self.buffers, self.slot, req)
            except Abandoned:  # the coordinator moved on (or went): the next wait says what to do
                self.bell.last_step = req.step
                continue
            except Exception as e:
                what = {StepKind.LOCKSTEP: "a lockstep decode step", StepKind.HEAD: "the lm_head",
                        StepKind.ATTENTION: f"attention of layer {req.layer}"}.get(req.kind, f"layer {req.layer}")
                self.send(WorkerFailed(self.worker_id, self.role, f"{what}: {type(e).__name__}: {e}"))
                return 1
            self.bell.finish(req.step, n_active, ns)

    def _abandon_check(self, step: int):
        """A lockstep step's check while it waits for the other processes: drop the step when the
        coordinator posted another, has a message for us (Shutdown) or is gone."""
        request = self.buffers.request

        def check() -> None:
            if request[REQ_STEP] != step or self.sock.poll(0) or self.lifeline.gone():
                raise Abandoned(f"step {step}")
        return check

    def close(self) -> None:
        if self.bell is not None:
            self.bell.close()
        if self.buffers is not None:
            self.buffers.close()
        if self.pool is not None:
            self.attn = None
            self.pool.close()
        self.sock.close()
        self.ctx.term()
