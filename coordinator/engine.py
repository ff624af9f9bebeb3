"""The coordinator's engine: one model, its worker processes, and the token loop.

    with Engine(path, EngineOptions()) as eng:
        for tok in eng.generate(eng.tokenizer.encode("Hello"), max_tokens=32): ...
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from sparsecore.config import ModelConfig, read_config
from sparsecore.errors import ModelFileError
from protocol.messages import WEIGHT_FORMATS
from protocol.shm_layout import INPUT_SITES
from sparsecore.gguf_file import check_supported_types, open_gguf
from sparsecore.kernels import interleaving
from sparsecore.kv_pool import KvPool, KvShape
from sparsecore.lm_head import head_tensor_name
from sparsecore.input_sparsity import attach as attach_twins
from sparsecore.lockstep import Lockstep
from sparsecore.predictor_rows import has_predictors
from sparsecore.shard import FileLayer
from sparsecore.tensors import TensorStore, conversion_notes

from .chat_template import chat_template_from_reader, render_chat
from .decode_plan import (DECODE_CHOICES, DecodePath, DecodePaths, DecodePlan, attention_heads, plan_decode,
                          why_not_native)
from .memory_plan import fit_hints, plan_memory
from .placement import (default_coordinator_share, default_gpu_share, plan_under_budget, resolve_threads,
                        split_vocabulary, static_plan)
from .sampling import Sampler, SamplingParams, pick_next
from .model_files import load_input_level, load_thresholds
from .tokenizer import GGUFTokenizer
from .worker_pool import WorkerPool

if TYPE_CHECKING:
    from .predictor import Predictors

# torch, and the modules that import it (1 s on these CPUs), are imported in Engine.__init__
# once the workers have been started: a worker on the file's blocks never imports torch, and it
# starts on another core meanwhile (bench_startup.py).


SPARSE_METHODS = ("input", "cats")  # EngineOptions.sparse_method


@dataclass
class EngineOptions:
    cpu_workers: int | None = None  # default: one per core left after the GPU worker
    threads: int | None = None  # cores to use in all; default: all
    gpu_share: float | None = None  # static share of each layer's neurons on the GPU worker
    ctx: int = 2048  # KV cache length (capped at the model's context length)
    max_batch: int = 256  # tokens per FFN exchange during prefill
    gpu_device: str = "auto"
    transport: str = "ipc"
    sparsity: float | None = None  # calibrated sparsity level for decoding; None = dense
    # How decoded tokens skip weights at `sparsity` (coordinator/tools/calibrate.py): "input"
    # (TEAL: every matrix skips the columns of its small inputs, read from input-major twins),
    # or "cats" (FFN neurons with small |act(gate x)| skip their up row and down row).
    sparse_method: str = "input"
    thresholds_file: str | None = None  # default: <model>.thresholds.json
    vram_budget_gb: float | None = None  # GiB for hot neurons on the GPU worker (needs <model>.profile.npz)
    reset_gpu_index: bool = False  # rebuild <model>.generated.gpuidx even if it matches
    disable_gpu_index: bool = False  # neither read nor write <model>.generated.gpuidx
    predictor: str | None = None  # predictor GGUF; default: the model's own fc1/fc2 if any; "none": off
    # How processes keep weights in memory: "gguf" (the default: the file's own blocks through
    # the native kernels, no float copy; fast arithmetic unless `fast` is False), "f32" (float32 copies,
    # torch ops), "int8" (per-row scales, a quarter of the bytes) or "f16" (half the bytes, for
    # the coordinator's attention matrices too; float16 products for one-token steps).
    weights: str = "gguf"
    # With weights "gguf": activations quantized to 8 bits per block of 32 (llama.cpp's
    # arithmetic; the default, as `--arith fast`) or, False, float32 times the dequantized
    # blocks (exact: transformers' tokens, what the reference tests compare). Other weight
    # formats ignore it.
    fast: bool = True
    # Per-layer exchange: spin on shared-memory doorbells (True), messages only (False), or
    # spin when the coordinator and every computing worker have a core each (None).
    spin: bool | None = None
    # Fraction of the CPU side's neurons (those not on the GPU worker) the coordinator computes
    # itself during each FFN step; None: default_coordinator_share.
    coordinator_share: float | None = None
    # With a coordinator share, split the lm_head's vocabulary rows across the same processes.
    split_lm_head: bool = True
    # Split decoded tokens' attention heads across the coordinator and the CPU workers (llama-
    # shaped attention in the file's blocks; the KV caches then live in shared memory).
    split_attention: bool = True
    # Which path decoded tokens take (coordinator/decode_plan.py, DECODE_CHOICES): "auto", the
    # best the processes support wherever a step's size pays for it; "lockstep" or "split",
    # that path at every size (and prompts' attention split at every size), refused at start
    # where the processes cannot take it (tests: a tiny model's layers never pay).
    decode_path: str = "auto"
    # The coordinator's spin governor backs off to sleeping when its spins are preempted
    # (protocol/doorbell.py SpinGovernor; steps then leave lockstep). False: it keeps spinning as
    # `spin` chose, whatever the machine's load (tests that must stay on one path); None: as
    # $SPARSEINFER_SYNC says (adaptive unless set).
    adaptive_spin: bool | None = None
    # KV caches in that shared memory: the engine's own, the chat REPL's, a server's slots
    # (`serve` asks for --parallel + 1). A sequence beyond them gets a private cache, and its
    # attention runs on the coordinator alone.
    kv_caches: int = 2
    # With `fast`, processes hold the FFN rows every step reads interleaved 16 by 16
    # (FileMatrix.interleave: a third of the vector work per token, shared by a batch): down
    # always, gate unless predictors pick rows, and up too if this says so, which then serves
    # dense steps only. None: up too when the engine starts dense (no `sparsity`, no
    # predictors) or with input sparsity (its sparse steps read twins); False: never up, for
    # tools that switch to CATS steps at run time.
    interleave: bool | None = None


@dataclass
class RunStats:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    token_times: list[float] = field(default_factory=list)


def required_tensors(cfg: ModelConfig) -> list[str]:
    """Every tensor the model needs, by the names the file itself uses: phi3's fused `attn_qkv`
    and `ffn_up` (gate and up) rather than the parts sparsecore.tensors.TensorStore shows."""
    names = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.tied_embeddings else ["output.weight"])
    fused = cfg.arch == "phi3"
    per_layer = ["attn_norm", "attn_output", "ffn_norm", "ffn_down"]
    per_layer += ["attn_qkv", "ffn_up"] if fused else ["attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"]
    if cfg.arch == "falcon":  # one norm (with bias) before both attention and the gate-less FFN
        names += ["output_norm.bias"]
        per_layer = ["attn_norm", "attn_norm.bias", "attn_output", "attn_qkv", "ffn_up", "ffn_down"]
    if cfg.qk_norm:
        per_layer += ["attn_q_norm", "attn_k_norm"]
    if cfg.post_norms:
        per_layer += ["post_attention_norm", "post_ffw_norm"]
    for i in range(cfg.n_layers):
        names += [f"blk.{i}.{n}" if n.endswith(".bias") else f"blk.{i}.{n}.weight" for n in per_layer]
        if cfg.qkv_bias:
            names += [f"blk.{i}.attn_{n}.bias" for n in "qkv"]
    return names


def _cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no GPU driver exposes a device
    (no /dev/nvidiactl, /dev/kfd or /dev/dxg: CUDA, ROCm and WSL's need one), so that the
    placement, made before the workers start, does not wait for the torch import."""
    if not any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


class Engine:
    """Load a model, plan where its neurons go, start the workers, and run the token loop."""

    def __init__(self, model_path: str | os.PathLike, opts: EngineOptions | None = None, launcher=None,
                 plan_only: bool = False):
        """plan_only: stop once the placement and the memory plan (self.memory) are made, before
        the check that refuses a plan that does not fit and before any process or cache exists
        (`sparseinfer info`)."""
        self.opts = opts = opts or EngineOptions()
        if opts.weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {opts.weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
        if opts.decode_path not in DECODE_CHOICES:
            raise ValueError(f"decode path {opts.decode_path!r}: one of {', '.join(DECODE_CHOICES)}")
        self.path = Path(model_path)
        reader = open_gguf(self.path)
        self.cfg = cfg = read_config(self.path, reader)
        names = {t.name for t in reader.tensors}
        missing = [n for n in required_tensors(cfg) if n not in names and n.replace("ffn_down", "ffn_down_t") not in names]
        if missing:
            raise ModelFileError(f"{self.path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
        down_t = [f"blk.{i}.ffn_down_t.weight" for i in range(cfg.n_layers)]
        check_supported_types(self.path, reader, [n for n in required_tensors(cfg) + down_t if n in names])
        if opts.weights == "gguf":  # say once which tensors cannot stay in the file's blocks
            wanted = set(required_tensors(cfg) + down_t)
            for line in conversion_notes(self.path, [t for t in reader.tensors if t.name in wanted]):
                print(line, file=sys.stderr)
        try:
            self.tokenizer = GGUFTokenizer.from_reader(reader)
        except ValueError as e:
            raise ModelFileError(f"{self.path}: tokenizer: {e}") from None
        self.chat_template = chat_template_from_reader(reader)
        predictors = self._load_predictors(reader)
        dense = opts.sparsity is None and predictors is None
        if opts.sparse_method not in SPARSE_METHODS:
            raise ValueError(f"sparse method {opts.sparse_method!r}: one of {', '.join(SPARSE_METHODS)}")
        # Which matrices the processes give input-major twins (sparsecore/input_sparsity.py): all
        # of them for input sparsity, down for CATS (its skipped neurons then skip whole rows).
        self.input_major = "" if dense or predictors is not None or opts.weights != "gguf" else \
            "all" if opts.sparse_method == "input" else "down"
        if opts.sparsity is not None:  # the thresholds exist before any worker starts (one clear error)
            self._thresholds(opts.sparsity)
        # Rows that only dense steps read whole: every step's with input sparsity, whose sparse
        # steps read the twins (prompts and batches then keep the dense engine's layout).
        rows_dense = dense or self.input_major == "all"
        if opts.interleave and not rows_dense:
            raise ValueError("interleaved up rows serve dense decoding only: not with CATS thresholds or predictors")
        # Which FFN rows the processes interleave (protocol.messages.ROW_LAYOUTS): down's are
        # with fast arithmetic whatever this says (every step reads them whole). Where the CPU
        # takes no interleaved layout (kernels.interleaving) nothing is, and nothing refused.
        self.row_layout = "" if not (opts.fast and opts.weights == "gguf" and interleaving()) or \
            predictors is not None else "gate+up" if rows_dense and opts.interleave is not False else "gate"
        # the model file's tensors, opened once; the tools (coordinator/tools/) read through it too
        self.store = store = TensorStore(self.path, reader)
        self.plan, self.plan_source, head_rows, per_worker, total = self._place(store)
        max_ctx = min(opts.ctx, cfg.context_length)
        # which processes compute decoded tokens' attention: decided now, the KV caches' place follows
        attn_heads, no_split = attention_heads(opts.split_attention, opts.weights, store, cfg, self.plan.shards)
        if opts.decode_path != "auto" and not attn_heads:
            raise ValueError(f"decode path {opts.decode_path}: attention cannot be split here: {no_split}")
        kv_shape = KvShape(max(1, opts.kv_caches) if attn_heads else 1, cfg.n_layers, cfg.n_kv_heads, max_ctx,
                           cfg.head_dim, cfg.rope_dim)
        self.memory = self._plan_memory(store, down_t, predictors, kv_shape)
        m = self.memory
        if self.input_major and m.available is not None and m.anonymous - m.twins <= m.available < m.anonymous:
            # The twins are what does not fit: decode densely rather than refuse to start.
            print(f"note: {self.path.name}: sparse decoding's input-major copies ({m.twins / 1e9:.2f} GB) do not "
                  f"fit in the {m.available / 1e9:.2f} GB available: decoding densely", file=sys.stderr)
            self.input_major, self.opts = "", replace(opts, sparsity=None)
            self.memory = self._plan_memory(store, down_t, predictors, kv_shape)
        if plan_only:
            return
        notice = self.memory.check(self.path, fit_hints(self.memory, kv_shape, max_ctx, self.memory.processes - 1))
        if notice:
            print(notice, file=sys.stderr)
        self.kv_pool = KvPool.create(kv_shape) if attn_heads else None
        try:
            self.pool = WorkerPool(self.path, self.plan, cfg.hidden, opts.max_batch, per_worker,
                                   opts.gpu_device, opts.transport, launcher=launcher, weights=opts.weights,
                                   spin=opts.spin, cores=total, head_rows=head_rows, fast=opts.fast,
                                   attn_heads={s: r for s, r in attn_heads.items() if s >= 0}, kv_pool=self.kv_pool,
                                   predictor_path=str(predictors.path) if predictors is not None and predictors.in_file
                                   else "", interleave=self.row_layout, input_major=self.input_major,
                                   adaptive_spin=opts.adaptive_spin)
        except BaseException:
            if self.kv_pool is not None:
                self.kv_pool.close()
            raise
        try:
            self.pool.spawn()  # workers start importing while we import torch, load our share and the head
            import torch

            from .model import Embedding, LmHead, Transformer
            from .sparse_ffn import SparseFfn, SplitHead

            # While workers spin on their cores, the coordinator computes on the one left to it.
            torch.set_num_threads(max(1, total - self.pool.spinning_workers) if self.pool.spin else total)
            self.ffn = SparseFfn.over(self.pool, store, predictors, opts.weights, opts.fast)
            in_file = opts.weights == "gguf"
            embed = Embedding(store, in_file, cfg.embed_scale)
            self.head = LmHead(store, cfg, embed, SplitHead.over(self.pool, self.ffn), in_file, opts.fast)
            # the decode plan needs what the workers can take (Ready), and the model is built with it
            self.pool.wait_ready()
            self.ffn.use_shard_predictors(all(w.predicts for w in self.pool.workers if w.n_neurons))
            paths = lambda native: self._decode_paths(store, attn_heads, no_split, native)  # noqa: E731
            self.model = Transformer(store, cfg, max_ctx, embed, self.ffn, self.head, opts.weights, opts.fast,
                                     self.kv_pool, paths)
            # after the attention's shares are kept (SplitAttention): their twins are the share's
            own_layers = {} if self.ffn.own is None else {
                i: w for i, w in self.ffn.own.layers.items() if isinstance(w, FileLayer)}
            head = self.ffn.own.head if self.ffn.own is not None and self.ffn.own.head is not None else self.head
            self.twins = attach_twins(self.pool.buffers.input_thresholds, self.input_major, own_layers,
                                      self.model.native, head, self.pool.buffers.head_threshold)
            self.twins.note()
            self.last = RunStats()
            self.sparsity: float | None = None
            self.set_sparsity(self.opts.sparsity)
        except BaseException:
            self.close()
            raise

    def _decode_paths(self, store: TensorStore, heads: dict[int, tuple[int, int]], no_split: str,
                      native: list) -> DecodePaths:
        """The decode plan (coordinator/decode_plan.py plan_decode) from what the processes
        support, and the objects that run its paths; the model calls this once while it is
        built, with its native attention steps (`native`, None for a layer without one)."""
        from .attention_split import SplitAttention  # torch's side: imported once the workers are started
        from .lockstep_decode import LockstepDecode

        cfg, pool = self.cfg, self.pool
        no_native = why_not_native(native, self.opts.weights, cfg)
        workers = tuple(sorted(s for s in heads if s >= 0))
        # Whole decode steps in lockstep where the coordinator and every worker with attention
        # heads can each take a part, and those are all the processes with neurons.
        own = self.ffn.own
        with_neurons = [s for s, w in enumerate(pool.proc_shards) if any(len(n) for n in w.neurons)]
        by_slot = {w.slot: w for w in pool.workers}
        part = None
        if not heads or no_native:
            no_lockstep = "attention is not split"
        elif own is None:
            no_lockstep = "the coordinator computes no FFN share"
        elif list(workers) != sorted(with_neurons):
            no_lockstep = "a process with neurons holds no attention heads"
        elif not all(s in by_slot and by_slot[s].lockstep for s in workers):
            no_lockstep = "a worker cannot take part (its neurons or heads are not in the file's blocks)"
        else:
            part = Lockstep.build(pool.buffers, pool.own_slot, native, heads[-1], own, store, cfg)
            no_lockstep = "" if part is not None else \
                "the coordinator cannot take part (its FFN share or the architecture)"
        plan = plan_decode(self.opts.decode_path, heads, no_split, not no_native, no_native, no_lockstep, workers,
                           every_token=self.input_major == "all")
        split = lockstep = None
        if plan.split:
            split = SplitAttention(pool.bell, pool.buffers, self.kv_pool, native, {s: heads[s] for s in workers},
                                   heads[-1], self.ffn.stats, plan.split_min_bytes, plan.every_token)
        if plan.path is DecodePath.LOCKSTEP:
            lockstep = LockstepDecode(pool.bell, pool.buffers, part, np.array(plan.lockstep_slots, dtype=np.intp),
                                      self.ffn, split, plan.lockstep_min_bytes)
        return DecodePaths(plan, split, lockstep)

    @property
    def decode_plan(self) -> DecodePlan:
        """Which path decoded tokens take, and why (coordinator/decode_plan.py)."""
        return self.model.decode_plan

    @property
    def predictors(self) -> Predictors | None:
        """The activation predictors decoding uses (None: thresholds or dense)."""
        return self.ffn.predictors

    @predictors.setter
    def predictors(self, p: Predictors | None) -> None:
        if p is not None and self.row_layout:
            raise ValueError("this engine holds its gate rows interleaved, which predictors cannot pick from: "
                             "start it with the predictors to decode with them")
        self.ffn.predictors = p

    @property
    def interleaved(self) -> bool:
        """Up's rows are interleaved too: the engine decodes densely only (row_layout)."""
        return self.row_layout == "gate+up"

    def _place(self, store: TensorStore):
        """(plan, where it came from, lm_head rows per slot, threads per worker, total threads)."""
        opts, cfg = self.opts, self.cfg
        cuda = opts.gpu_device in ("auto", "cuda") and _cuda_available()
        total, n_cpu, per_worker = resolve_threads(opts.threads, opts.cpu_workers, cuda)
        share = default_gpu_share(cuda) if opts.gpu_share is None else opts.gpu_share
        if opts.vram_budget_gb is not None and opts.coordinator_share:
            raise ValueError("--coordinator-share goes with the static split, not with --vram-budget")
        if opts.vram_budget_gb is not None:  # hot neurons by activation profile, within the budget
            plan, _, source = plan_under_budget(
                self.path, cfg.n_layers, cfg.n_ff, cfg.hidden, opts.vram_budget_gb, n_cpu,
                opts.reset_gpu_index, opts.disable_gpu_index, weights=opts.weights)
        else:
            coord = (default_coordinator_share(cuda, n_cpu, per_worker) if opts.coordinator_share is None
                     else opts.coordinator_share)
            # the native kernels read down's columns in whole blocks: cut shards on block edges
            align = max(FileLayer.align(store, i) for i in range(cfg.n_layers)) if opts.weights == "gguf" else 1
            plan, source = static_plan(cfg.n_layers, cfg.n_ff, share, n_cpu, coord, align), "static"
        head_rows = {}
        if opts.split_lm_head:
            n_vocab = store.shape(head_tensor_name(cfg.tied_embeddings))[0]
            head_rows = split_vocabulary(plan, n_vocab, opts.max_batch * cfg.hidden)
        return plan, source, head_rows, per_worker, total

    def _plan_memory(self, store: TensorStore, down_t: list[str], predictors, kv_shape):
        """What this run will hold (coordinator/memory_plan.py), before any worker starts."""
        opts, cfg = self.opts, self.cfg
        names = required_tensors(cfg) + [n for n in down_t if store.has(n)]
        if predictors is not None and predictors.in_file and Path(predictors.path) == self.path:
            names += [f"blk.{i}.{n}.weight" for i in range(cfg.n_layers) for n in ("fc1", "fc2")]
        # the worker processes WorkerPool.spawn starts: those with neurons (a GPU worker without CUDA has none)
        workers = [s for s in self.plan.shards if s.role != "coordinator" and any(len(n) for n in s.neurons)]
        ffn = sum(any(len(n) for n in s.neurons) for s in self.plan.shards)
        return plan_memory(store, cfg, names, fast=opts.fast, weights=opts.weights, row_layout=self.row_layout,
                           sparse=opts.sparsity is not None or predictors is not None, n_workers=len(workers),
                           ffn_processes=ffn, kv_shape=kv_shape, input_major=self.input_major)

    def _load_predictors(self, reader) -> Predictors | None:
        p = self.opts.predictor
        if p == "none":
            return None
        if p is not None:
            if self.opts.sparsity is not None:
                raise ValueError("choose one sparsity source: --sparsity (thresholds) or --predictor, not both")
            from .predictor import Predictors  # torch: imported before the workers start only with predictors

            return Predictors.load(p, self.cfg, in_file=self.opts.weights == "gguf", fast=self.opts.fast)
        # A model's own predictors are the default unless thresholds were asked for explicitly.
        if self.opts.sparsity is None and has_predictors(reader):
            from .predictor import Predictors

            return Predictors.load(self.path, self.cfg, reader, self.opts.weights == "gguf", self.opts.fast)
        return None

    def _thresholds(self, sparsity: float) -> list:
        """The calibrated thresholds of `sparsity` by the engine's method: CATS's per layer, or
        input sparsity's (per layer and site, the lm_head's); ValueError naming the file and how
        to calibrate when they are missing."""
        path = Path(self.opts.thresholds_file) if self.opts.thresholds_file else None
        if self.opts.sparse_method == "input":
            return load_input_level(self.path, sparsity, path)
        return load_thresholds(self.path, sparsity, path)

    def set_sparsity(self, sparsity: float | None) -> None:
        """Decode with the calibrated thresholds of `sparsity` from now on, by the engine's
        method (EngineOptions.sparse_method); None: dense."""
        if sparsity is not None and self.interleaved and self.opts.sparse_method != "input":
            raise ValueError("this engine holds its up rows interleaved for dense decoding (EngineOptions.interleave): "
                             "start it with --sparsity, or with interleave=False, to decode sparsely")
        if sparsity is not None and self.ffn.predictors is not None:
            raise ValueError("predictors are active: threshold sparsity and predictors are exclusive")
        words = self.pool.buffers.input_thresholds
        self.pool.buffers.head_threshold[0] = -1.0
        if sparsity is None:
            self.ffn.set_thresholds(None)
            words[:] = -1.0
        elif self.opts.sparse_method == "input":
            if self.input_major != "all":
                raise ValueError("input sparsity needs the input-major twins made at load: start the engine "
                                 "with a sparsity level")
            per_layer, head = self._thresholds(sparsity)
            words[:] = np.asarray(per_layer, dtype=np.float32)
            self.pool.buffers.head_threshold[0] = head
            self.ffn.set_thresholds(None)  # the steps are dense to the protocol: the twins skip
        else:
            self.ffn.set_thresholds(self._thresholds(sparsity))
            words[:] = -1.0
            if self.input_major:  # down's twins skip the neurons CATS zeroed (h == 0)
                words[:, INPUT_SITES.index("ffn_h")] = 0.0
        self.sparsity = sparsity

    # ---- public API -------------------------------------------------------------------------

    def reset(self) -> None:
        self.model.cache.reset()

    def check_workers(self) -> None:
        """Raise WorkerError naming a worker that failed or died (also while idle)."""
        self.pool.check_alive()

    def forward_logits(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits for every position of `ids`, from a fresh KV cache."""
        self.reset()
        return self.model.forward(list(ids), all_logits=True).numpy()

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stop_at_eos: bool = True, constraint=None) -> Iterator[int]:
        """The tokens after `prompt_ids`, one at a time. `constraint`: a
        structured_output.Constraint the reply follows (it ends when the grammar is complete)."""
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to condition on")
        if len(prompt_ids) + max_tokens > self.model.max_ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + {max_tokens} new tokens exceeds the "
                             f"context size {self.model.max_ctx} (raise --ctx)")
        sampler = Sampler(sampling or SamplingParams())
        self.reset()
        st = self.last = RunStats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        logits = self.model.forward(list(prompt_ids))[-1].numpy()
        st.prefill_s = time.perf_counter() - t0
        eos = self.tokenizer.eos_ids
        history = list(prompt_ids)  # what the repeat/presence/frequency penalties look back on
        for i in range(max_tokens):
            pick = pick_next(logits, sampler, history, eos, stop_at_eos, constraint)  # the scheduler's step too
            tok = pick.token
            yield tok
            if pick.end is not None or i == max_tokens - 1:
                return
            t1 = time.perf_counter()
            logits = self.model.forward([tok])[-1].numpy()
            dt = time.perf_counter() - t1
            st.decode_s += dt
            st.decode_tokens += 1
            st.token_times.append(dt)

    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        """The user's text wrapped in the model's own chat template (ChatML when it has none)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
        return self.render_messages(messages)

    def render_messages(self, messages: list[dict], **variables) -> str:
        """A conversation (dicts with "role" and "content") as the prompt text the model's chat
        template makes of it, ending where the assistant's reply begins. `variables` reach the
        template too (`tools`)."""
        tk = self.tokenizer
        bos = tk.tokens[tk.bos_id] if tk.bos_id is not None else ""
        eos = tk.tokens[tk.eos_id] if tk.eos_id is not None else ""
        return render_chat(self.chat_template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos,
                           **variables)

    def encode_chat(self, messages: list[dict], **variables) -> list[int]:
        """Token ids of a rendered conversation: no second BOS when the template wrote one."""
        text = self.render_messages(messages, **variables)
        tk = self.tokenizer
        has_bos = tk.bos_id is not None and text.startswith(tk.tokens[tk.bos_id])
        return tk.encode(text, add_bos=False if has_bos else None)

    def stats(self) -> dict:
        return {
            "sync_us": list(self.ffn.stats.overhead_us),
            "round_trip_us": list(self.ffn.stats.round_trip_us),
            "prefill_s": self.last.prefill_s,
            "decode_s": self.last.decode_s,
            "decode_tokens": self.last.decode_tokens,
            "prompt_tokens": self.last.prompt_tokens,
            "weights": self.opts.weights,
            "worker_weight_bytes": [w.weight_bytes for w in self.pool.workers],
            "coordinator_ffn_bytes": self.ffn.own.nbytes if self.ffn.own is not None else 0,
        }

    def close(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.close()
        if getattr(self, "model", None) is not None:
            self.model.close_split()
        if getattr(self, "kv_pool", None) is not None:
            self.kv_pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
