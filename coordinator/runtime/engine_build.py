"""Building an engine: `EngineBuilder` turns (model path, EngineOptions) into the parts an
Engine runs (coordinator/runtime/engine.py), in two stages:

  - `EngineBuilder(path, opts)` plans: checks the options, reads and checks the file (config,
    chat template, predictors, thresholds), places the neurons and the lm_head's rows, and
    works out the memory plan. No process, shared memory or torch yet: this is all
    `Engine(path, opts, plan_only=True)` (`sparseinfer info`) does.
  - `start(launcher)` refuses a plan that does not fit, makes the shared KV caches, spawns the
    worker pool (which loads on another core meanwhile: bench_startup.py), and builds the
    tokenizer, the FFN, the head, the model's layers, then its decode plan (which waits for
    the workers' Ready), and the input-major twins. torch is imported only
    by the paths that need it (coordinator/model/torch_layers.py, predictors, float copies, a GPU):
    a plain llama model in the file's blocks starts without it. On any failure it closes what it
    made (`close`): no process or shared memory is left behind.

Also here: `required_tensors` (what a model file must hold) and `load_level` (a sparsity
level's calibrated thresholds by the engine's method).
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sparsecore.config import ModelConfig, read_config
from sparsecore.errors import ModelFileError
from sparsecore.gguf_file import check_supported_types, open_gguf
from sparsecore.input_sparsity import attach as attach_twins
from sparsecore.kernels import interleaving, isa, layout_cache
from sparsecore.kv_pool import KvPool, KvShape
from sparsecore.lm_head import head_tensor_name
from sparsecore.lockstep import Lockstep
from sparsecore.predictor_rows import has_predictors
from sparsecore.rope import layer_tables
from sparsecore.experts import ExpertsLayer
from sparsecore.file_layer import FileLayer
from sparsecore.tensors import TensorStore, conversion_notes

from .. import set_torch_threads
from ..text.tokenizer import GGUFTokenizer, chat_template_from_reader
from .decode_plan import DecodePath, DecodePaths, attention_heads, plan_decode, why_not_native
from .engine_options import SPARSE_METHODS, EngineOptions, check
from .memory_plan import fit_hints, plan_memory
from .model_files import load_input_level, load_thresholds, profile_path
from .model_fetch import cache_root
from .residency import cold_units
from .placement import (deal_experts, default_coordinator_share, default_gpu_share, expert_plan, experts_under_budget,
                        plan_under_budget, resolve_threads, split_vocabulary, static_plan)
from .worker_pool import WorkerPool

if TYPE_CHECKING:
    from ..model.predictor import Predictors

# torch's import takes about 1 s on these CPUs: nothing here imports it, and the model and the
# FFN import it only where a path needs it (coordinator/model/transformer.py).


def required_tensors(cfg: ModelConfig) -> list[str]:
    """Every tensor the model needs, by the names the file itself uses (sparsecore/arch.py)."""
    return cfg.spec.required_tensors(cfg.n_layers, cfg.tied_embeddings, cfg.qkv_bias, cfg.qk_norm, cfg.routed)


def load_level(model: Path, opts: EngineOptions, sparsity: float) -> list:
    """The calibrated thresholds of `sparsity` by `opts.sparse_method`: CATS's per layer, or
    input sparsity's (per layer and site, the lm_head's); ValueError naming the file and how
    to calibrate when they are missing."""
    path = Path(opts.thresholds_file) if opts.thresholds_file else None
    if opts.sparse_method == "input":
        return load_input_level(model, sparsity, path)
    return load_thresholds(model, sparsity, path)


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no GPU driver exposes a device
    (no /dev/nvidiactl, /dev/kfd or /dev/dxg: CUDA, ROCm and WSL's need one), so that the
    placement, made before the workers start, does not wait for the torch import."""
    if not any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()


class EngineBuilder:
    """An engine's parts, planned by the constructor and started by `start` (module doc).

    Planned: opts (with sparsity dropped where the twins do not fit), path, cfg, chat_template,
    predictors, input_major, row_layout, store, plan, plan_source, memory.
    Started: kv_pool, pool, ffn, head, model, twins; the tokenizer (load_tokenizer) on the way."""

    def __init__(self, model_path: str | os.PathLike, opts: EngineOptions):
        self.opts = opts
        check(opts)
        self.path = Path(model_path)
        reader = open_gguf(self.path)
        self.cfg = cfg = read_config(self.path, reader)
        names = {t.name for t in reader.tensors}
        missing = [n for n in required_tensors(cfg) if n not in names and n.replace("ffn_down", "ffn_down_t") not in names]
        if missing:
            raise ModelFileError(f"{self.path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
        if cfg.routed:  # what routed experts (ExpertsLayer, TorchExpertsLayer) run with so far
            refused = [what for what, on in (("--weights " + opts.weights, opts.weights != "gguf" and cfg.expert_bias),
                                             ("--sparse-method input (experts take CATS thresholds)",
                                              opts.sparsity is not None and opts.sparse_method == "input"),
                                             ("--vram-budget (gpt-oss's experts split by ranges only)",
                                              opts.vram_budget_gb is not None and cfg.expert_bias),
                                             ("--predictor", bool(opts.predictor) and opts.predictor != "none"))
                       if on]
            if refused:
                raise ValueError(f"{self.path.name}: a mixture-of-experts model runs its experts dense or with CATS "
                                 f"thresholds: not with {refused[0]}")
        if cfg.router_reads_layer_input and opts.max_batch < 2:  # sparse_ffn.py: x[n:2n] carries it
            raise ValueError(f"{self.path.name}: --max-batch {opts.max_batch}: {cfg.arch}'s router reads the layer's "
                             f"input, which an exchange carries beside each token's FFN input: at least 2")
        self.down_t = down_t = [f"blk.{i}.ffn_down_t.weight" for i in range(cfg.n_layers)]
        check_supported_types(self.path, reader, [n for n in required_tensors(cfg) + down_t if n in names])
        if opts.weights == "gguf":  # say once which tensors cannot stay in the file's blocks
            wanted = set(required_tensors(cfg) + down_t)
            for line in conversion_notes(self.path, [t for t in reader.tensors if t.name in wanted]):
                print(line, file=sys.stderr)
        self._reader, self._tokenizer = reader, None  # the tokenizer is built once, when asked (load_tokenizer)
        self.chat_template = chat_template_from_reader(reader)
        self.predictors = predictors = self._load_predictors(reader)
        dense = opts.sparsity is None and predictors is None
        if opts.sparse_method not in SPARSE_METHODS:
            raise ValueError(f"sparse method {opts.sparse_method!r}: one of {', '.join(SPARSE_METHODS)}")
        # Which matrices the processes give input-major twins (sparsecore/input_sparsity.py): all
        # of them for input sparsity, down for CATS (its skipped neurons then skip whole rows).
        self.input_major = "" if dense or predictors is not None or opts.weights != "gguf" else \
            "all" if opts.sparse_method == "input" else "down"
        if opts.sparsity is not None:  # the thresholds exist before any worker starts (one clear error)
            load_level(self.path, opts, opts.sparsity)
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
        # a routed model's experts under --vram-budget (placement.experts_under_budget), else None
        self.expert_placement: dict | None = None
        self.plan, self.plan_source, self.head_rows, self.per_worker, self.total = self._place(store)
        self.max_ctx = min(opts.ctx, cfg.context_length)
        # which processes compute decoded tokens' attention: decided now, the KV caches' place follows
        self.attn_heads, self.no_split = attention_heads(opts.split_attention, opts.weights, store, cfg,
                                                         self.plan.shards)
        if opts.decode_path != "auto" and not self.attn_heads:
            raise ValueError(f"decode path {opts.decode_path}: attention cannot be split here: {self.no_split}")
        self.kv_shape = KvShape(max(1, opts.kv_caches) if self.attn_heads else 1, cfg.n_layers, cfg.n_kv_heads,
                                self.max_ctx, cfg.head_dim, cfg.rope_dim, len(layer_tables(cfg)[0]))
        self.memory = self._plan_memory()
        m = self.memory
        if self.input_major and m.available is not None and m.available < m.anonymous:
            # Not everything fits: the twins go first (a copy of the matrices they twin) and the
            # run decodes densely, rather than refuse to start; what still does not fit is then
            # mapped from the layout cache (below). Twins held beside mapped layouts would take the
            # memory the plan leaves to them (a calibrated 1.45 GB Q8_0 under 1000 MB was killed).
            print(f"note: {self.path.name}: sparse decoding's input-major copies ({m.twins / 1e9:.2f} GB) do not "
                  f"fit in the {m.available / 1e9:.2f} GB available: decoding densely", file=sys.stderr)
            self.input_major, self.opts = "", replace(opts, sparsity=None)
            self.memory = self._plan_memory()
        # the repacked layouts' directory, and which FFN units stay mapped from it where they do
        # not all fit (coordinator/runtime/residency.py)
        self.layout_root = layout_root(opts.layout_cache, self.path) if opts.weights == "gguf" else ""
        self.cold = cold_units(self.memory, store, cfg, profile_path(self.path)) if self.layout_root else None
        self.deal = self._deal()
        self.kv_pool = self.pool = self.ffn = self.head = self.model = self.twins = None

    def load_tokenizer(self) -> GGUFTokenizer:
        """The file's tokenizer, built once: `start` builds it while the workers load (0.14 s for
        a 32k vocabulary, which the workers' start then no longer waits for)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = GGUFTokenizer.from_reader(self._reader)
            except ValueError as e:
                raise ModelFileError(f"{self.path}: tokenizer: {e}") from None
        return self._tokenizer

    # ---- stage 2: processes and the model ------------------------------------------------------

    def start(self, launcher=None) -> None:
        """Refuse a plan that does not fit, then make the KV caches' shared memory, the worker
        pool, the FFN, the head, the model and the twins; closes what it made on failure."""
        opts, cfg = self.opts, self.cfg
        notice = self.memory.check(self.path, fit_hints(self.memory, self.kv_shape, self.max_ctx,
                                                        self.memory.processes - 1), self.layout_root)
        if notice:
            print(notice, file=sys.stderr)
        self.kv_pool = KvPool.create(self.kv_shape) if self.attn_heads else None
        predictors = self.predictors
        try:
            self.pool = WorkerPool(self.path, self.plan, cfg.hidden, opts.max_batch, self.per_worker,
                                   opts.gpu_device, opts.transport, launcher=launcher, weights=opts.weights,
                                   spin=opts.spin, cores=self.total, head_rows=self.head_rows, fast=opts.fast,
                                   attn_heads={s: r for s, r in self.attn_heads.items() if s >= 0},
                                   kv_pool=self.kv_pool,
                                   predictor_path=str(predictors.path) if predictors is not None and predictors.in_file
                                   else "", row_layout=self.row_layout, input_major=self.input_major,
                                   adaptive_spin=opts.adaptive_spin, layout_cache=self.layout_root,
                                   cold_units=self.cold, n_experts=cfg.n_experts, deal=self.deal)
        except BaseException:
            if self.kv_pool is not None:
                self.kv_pool.close()
            raise
        try:
            # our conversions, as the workers', from the cache (each process's directory is its level's)
            with layout_cache.using(layout_cache.level_directory(self.layout_root, self.path),
                                    copy_held=self.cold is not None):
                self._load(launcher)
        except BaseException:
            self.close()
            raise

    def _load(self, launcher) -> None:
        """start's loading: the workers, our share, the head, the model and the twins."""
        opts, cfg, store, predictors = self.opts, self.cfg, self.store, self.predictors
        self.pool.spawn()  # workers load while we build the tokenizer, our share, the head and the model
        self.load_tokenizer()
        from ..model.transformer import Embedding, LmHead, Transformer
        from .sparse_ffn import SparseFfn, SplitHead

        # While workers spin on their cores, torch (where a path imports it) computes on the
        # one left to the coordinator.
        set_torch_threads(max(1, self.total - self.pool.spinning_workers) if self.pool.spin else self.total)
        self.ffn = SparseFfn.over(self.pool, store, predictors, opts.weights, opts.fast)
        in_file = opts.weights == "gguf"
        embed = Embedding(store, in_file, cfg.embed_scale)
        self.head = LmHead(store, cfg, embed, SplitHead.over(self.pool, self.ffn), in_file, opts.fast)
        # our FFN share's and head's twins while the workers load (repacking them is most of a
        # sparse start: 1.1B Q4_0 at --sparsity 0.5, 0.5 s here)
        own_layers = {} if self.ffn.own is None else {
            i: w for i, w in self.ffn.own.layers.items() if isinstance(w, (FileLayer, ExpertsLayer))}
        head = self.ffn.own.head if self.ffn.own is not None and self.ffn.own.head is not None else self.head
        thresholds = self.pool.buffers.input_thresholds
        self.twins = attach_twins(thresholds, self.input_major, own_layers, None, head,
                                  self.pool.buffers.head_threshold)
        # the model's layers, then its decode plan, which waits for the workers (_decode_paths)
        self.model = Transformer(store, cfg, self.max_ctx, embed, self.ffn, self.head, opts.weights, opts.fast,
                                 self.kv_pool, self._decode_paths)
        # the attention's twins after its shares are kept (SplitAttention): they are the share's
        attach_twins(thresholds, self.input_major, None, self.model.native, twins=self.twins)
        self.twins.note()

    def close(self) -> None:
        """Stop the workers and free the shared memory: what Engine.close does too."""
        close_started(self.pool, self.model, self.kv_pool)

    def _decode_paths(self, native: list) -> DecodePaths:
        """The decode plan (coordinator/runtime/decode_plan.py plan_decode) from what the processes
        support, and the objects that run its paths; the model calls this once while it is
        built, with its native attention steps (`native`, None for a layer without one): the
        workers load meanwhile, and their Ready says what each can take."""
        self.pool.wait_ready()
        self.ffn.use_shard_predictors(all(w.predicts for w in self.pool.workers if w.n_neurons))
        from .attention_split import SplitAttention  # torch's side: imported once the workers are started
        from .lockstep_decode import LockstepDecode

        cfg, pool, heads = self.cfg, self.pool, self.attn_heads
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
            part = Lockstep.build(pool.buffers, pool.own_slot, native, heads[-1], own, self.store, cfg)
            no_lockstep = "" if part is not None else \
                "the coordinator cannot take part (its FFN share or the architecture)"
        plan = plan_decode(self.opts.decode_path, heads, self.no_split, not no_native, no_native, no_lockstep,
                           workers, every_token=self.input_major == "all")
        split = lockstep = None
        if plan.split:
            split = SplitAttention(pool.bell, pool.buffers, self.kv_pool, native, {s: heads[s] for s in workers},
                                   heads[-1], self.ffn.stats, plan.split_min_bytes, plan.every_token)
        if plan.path is DecodePath.LOCKSTEP:
            lockstep = LockstepDecode(pool.bell, pool.buffers, part, np.array(plan.lockstep_slots, dtype=np.intp),
                                      self.ffn, split, plan.lockstep_min_bytes, pool.head_rows)
        return DecodePaths(plan, split, lockstep)

    # ---- stage 1's parts ---------------------------------------------------------------------

    def _place(self, store: TensorStore):
        """(plan, where it came from, lm_head rows per slot, threads per worker, total threads)."""
        opts, cfg = self.opts, self.cfg
        self.cuda = cuda = opts.gpu_device in ("auto", "cuda") and cuda_available()
        total, n_cpu, per_worker = resolve_threads(opts.threads, opts.cpu_workers, cuda)
        share = default_gpu_share(cuda) if opts.gpu_share is None else opts.gpu_share
        if opts.vram_budget_gb is not None and opts.coordinator_share:
            raise ValueError("--coordinator-share goes with the static split, not with --vram-budget")
        align = max(FileLayer.align(store, i) for i in range(cfg.n_layers)) if opts.weights == "gguf" else 1
        shares = None  # the plan the head's rows follow, where not the plan itself (below)
        if opts.vram_budget_gb is not None and cfg.routed:  # the most-routed experts, whole, within the budget
            self.expert_placement = placed = experts_under_budget(self.path, store, cfg, opts.vram_budget_gb,
                                                                  opts.weights, cuda)
            coord = default_coordinator_share(cuda, n_cpu, per_worker)
            plan = expert_plan(cfg.n_layers, cfg.n_ff, placed["experts"], cfg.n_experts, bool(cfg.n_ff_shared),
                               n_cpu, coord, align)
            source = (f"{placed['placed']} most-routed experts on the GPU worker, predicted "
                      f"{100 * placed['predicted_share']:.1f}% of the routed work")
        elif opts.vram_budget_gb is not None:  # hot neurons by activation profile, within the budget
            plan, _, source = plan_under_budget(
                self.path, cfg.n_layers, cfg.n_ff, cfg.hidden, opts.vram_budget_gb, n_cpu,
                opts.reset_gpu_index, opts.disable_gpu_index, weights=opts.weights)
        else:
            coord = (default_coordinator_share(cuda, n_cpu, per_worker) if opts.coordinator_share is None
                     else opts.coordinator_share)
            # the native kernels read down's columns in whole blocks: cut shards on block edges
            plan, source = static_plan(cfg.n_layers, cfg.n_ff, share, n_cpu, coord, align), "static"
            # The head's rows follow the processes' intended shares, not the FFN's cuts on block
            # edges: a K-quant expert's 768 neurons split 512/256 between two processes (blocks
            # of 256), and head rows in that proportion made its phase wait on the larger share
            # (the 30B-A3B shape in Q4_K_M decoded 71.3 tok/s, 76.4 with the rows even).
            if align > 1:
                shares = static_plan(cfg.n_layers, cfg.n_ff, share, n_cpu, coord, 1)
        head_rows = {}
        if opts.split_lm_head:
            n_vocab = store.shape(head_tensor_name(cfg.tied_embeddings))[0]
            head_rows = split_vocabulary(plan, n_vocab, opts.max_batch * cfg.hidden, shares)
        return plan, source, head_rows, per_worker, total

    def _deal(self) -> dict[int, tuple[int, int]]:
        """Whether the CPU's processes deal a token's chosen experts among them, each computing
        whole experts (placement.deal_experts), instead of each a range of every one: where every
        process maps the same layouts from the layout cache (one copy in memory, whatever the
        processes), so everything is held and no twin is made (both are copies per process).
        Balanced where ranges cannot be: a K-quant expert of 768 neurons splits 512/256 (blocks of
        256); the 30B-A3B shape in Q4_K_M decoded 4-22 % and prefilled 9-16 % faster dealt (Q4_0:
        1-10 % and about the same), on 2 cores at AVX2.
        SPARSEINFER_EXPERT_SPLIT=ranges keeps the ranges."""
        cfg, opts = self.cfg, self.opts
        split = os.environ.get("SPARSEINFER_EXPERT_SPLIT", "dealt")
        if split not in ("dealt", "ranges"):
            raise ValueError(f"SPARSEINFER_EXPERT_SPLIT={split!r}: dealt or ranges")
        if (split == "ranges" or not cfg.routed or opts.weights != "gguf" or not self.layout_root
                or self.cold is not None or self.input_major):
            return {}
        return deal_experts(self.plan)

    def _plan_memory(self):
        """What this run will hold (coordinator/runtime/memory_plan.py), before any worker starts."""
        opts, cfg, store, predictors = self.opts, self.cfg, self.store, self.predictors
        names = required_tensors(cfg) + [n for n in self.down_t if store.has(n)]
        if predictors is not None and predictors.in_file and Path(predictors.path) == self.path:
            names += [f"blk.{i}.{n}.weight" for i in range(cfg.n_layers) for n in ("fc1", "fc2")]
        # the worker processes WorkerPool.spawn starts: those with neurons (a GPU worker without CUDA has none)
        workers = [s for s in self.plan.shards if s.role != "coordinator" and any(len(n) for n in s.neurons)]
        ffn = sum(any(len(n) for n in s.neurons) for s in self.plan.shards)
        # a routed model's experts on a CUDA device are not in RAM (placement.gpu_expert_bytes each, there)
        placed = self.expert_placement if self.cuda else None
        return plan_memory(store, cfg, names, fast=opts.fast, weights=opts.weights, row_layout=self.row_layout,
                           sparse=opts.sparsity is not None or predictors is not None, n_workers=len(workers),
                           ffn_processes=ffn, kv_shape=self.kv_shape, input_major=self.input_major,
                           gpu_experts=None if placed is None else [len(e) / cfg.n_experts for e in placed["experts"]],
                           vram=0 if placed is None else placed["placed"] * placed["expert_bytes"])

    def _load_predictors(self, reader) -> Predictors | None:
        p = self.opts.predictor
        if p == "none":
            return None
        if p is not None:
            if self.opts.sparsity is not None:
                raise ValueError("choose one sparsity source: --sparsity (thresholds) or --predictor, not both")
            from ..model.predictor import Predictors  # torch: imported before the workers start only with predictors

            return Predictors.load(p, self.cfg, in_file=self.opts.weights == "gguf", fast=self.opts.fast)
        # A model's own predictors are the default unless thresholds were asked for explicitly.
        if self.opts.sparsity is None and has_predictors(reader):
            from ..model.predictor import Predictors

            return Predictors.load(self.path, self.cfg, reader, self.opts.weights == "gguf", self.opts.fast)
        return None


def close_started(pool: WorkerPool | None, model, kv_pool: KvPool | None) -> None:
    """Close what a start made, in the order that frees it: the workers, the split attention's
    hold on the shared KV caches, the caches themselves."""
    if pool is not None:
        pool.close()
    if model is not None:
        model.close_split()
    if kv_pool is not None:
        kv_pool.close()


def layout_root(option: str | None, model: Path) -> str:
    """The layout caches' root directory, or "" for none: `option` a directory or "off"; None:
    $SPARSEINFER_LAYOUT_CACHE, else <cache>/layouts. Earlier versions of this model's caches
    (another size or mtime) are removed."""
    root = option if option is not None else os.environ.get("SPARSEINFER_LAYOUT_CACHE") or str(cache_root() / "layouts")
    if str(root) == "off":
        return ""
    try:
        d = layout_cache.model_directory(Path(root), model, isa())
        d.mkdir(parents=True, exist_ok=True)
        layout_cache.prune_stale(d)
    except OSError as e:
        print(f"note: layout cache {root}: {e.strerror}: layouts are made at every start", file=sys.stderr)
        return ""
    return str(root)
