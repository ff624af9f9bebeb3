"""The coordinator's engine: one model, its worker processes, and the token loop.

    with Engine(path, EngineOptions()) as eng:
        for tok in eng.generate(eng.tokenizer.encode("Hello"), max_tokens=32): ...
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from sparsecore.config import ModelConfig, read_config
from sparsecore.errors import ModelFileError
from sparsecore.ffn import WEIGHT_FORMATS
from sparsecore.gguf_file import check_supported_types, open_gguf
from sparsecore.tensors import TensorStore

from .attention_model import AttentionModel
from .chat_template import chat_template_from_reader, render_chat
from .placement import plan_under_budget, static_plan
from .predictor import Predictors, has_predictors
from .sampling import Sampler, SamplingParams
from .model_files import load_thresholds
from .tokenizer import GGUFTokenizer
from .worker_pool import WorkerPool


@dataclass
class EngineOptions:
    cpu_workers: int | None = None  # default: one per core left after the GPU worker
    threads: int | None = None  # cores to use in all; default: all
    gpu_share: float | None = None  # static share of each layer's neurons on the GPU worker
    ctx: int = 2048  # KV cache length (capped at the model's context length)
    max_batch: int = 256  # tokens per FFN exchange during prefill
    gpu_device: str = "auto"
    transport: str = "ipc"
    sparsity: float | None = None  # calibrated CATS threshold level for decoding; None = dense
    thresholds_file: str | None = None  # default: <model>.thresholds.json
    vram_budget_gb: float | None = None  # GiB for hot neurons on the GPU worker (needs <model>.profile.npz)
    reset_gpu_index: bool = False  # rebuild <model>.generated.gpuidx even if it matches
    disable_gpu_index: bool = False  # neither read nor write <model>.generated.gpuidx
    predictor: str | None = None  # predictor GGUF; default: the model's own fc1/fc2 if any; "none": off
    # How workers keep FFN rows in memory: "f32" (exact float32 arithmetic, what the oracle
    # tests compare against transformers), "int8" (per-row scales, a quarter of the bytes) or
    # "f16" (half the bytes, for the coordinator's attention matrices too; float16 products
    # for one-token steps).
    weights: str = "f32"
    # Per-layer exchange: spin on shared-memory doorbells (True), messages only (False), or
    # spin when the coordinator and every computing worker have a core each (None).
    spin: bool | None = None
    # Fraction of the CPU side's neurons (those not on the GPU worker) the coordinator computes
    # itself during each FFN step; None: default_coordinator_share.
    coordinator_share: float | None = None
    # With a coordinator share, split the lm_head's vocabulary rows across the same processes.
    split_lm_head: bool = True


@dataclass
class RunStats:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    token_times: list[float] = field(default_factory=list)


def resolve_threads(opts: EngineOptions, cuda: bool = False) -> tuple[int, int, int]:
    """(total threads, cpu workers, threads per worker) without oversubscribing the cores.
    The coordinator keeps one core; the workers share the rest. Without CUDA the GPU worker
    holds no neuron by default (see default_gpu_share), so every other core gets a CPU worker;
    with CUDA the GPU worker's feeding thread takes a core too."""
    total = opts.threads or os.cpu_count() or 1
    default_cpu = max(1, total - 2) if cuda else max(1, total - 1)
    n_cpu = opts.cpu_workers if opts.cpu_workers is not None else default_cpu
    per_worker = max(1, (total - 1) // n_cpu) if total > 1 else 1
    return total, n_cpu, per_worker


def default_gpu_share(cuda: bool) -> float:
    """Half of each layer on a real GPU. Without one the GPU worker would be one more CPU process
    competing for the cores: it holds nothing, and the CPU workers take every neuron."""
    return 0.5 if cuda else 0.0


def default_coordinator_share(cuda: bool, n_cpu: int, per_worker: int) -> float:
    """Without CUDA the coordinator's core only waits while the workers compute a layer's FFN,
    so it takes a core's share of the neurons (SmolLM2 on 2 cores: two processes computing half
    a layer each took 470 us against 810 us for one computing all of it). With CUDA its core
    feeds the GPU worker and it takes none."""
    return 0.0 if cuda else 1.0 / (1 + n_cpu * per_worker)


def required_tensors(cfg: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.tied_embeddings else ["output.weight"])
    for i in range(cfg.n_layers):
        names += [f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
    return names


class Engine:
    def __init__(self, model_path: str | os.PathLike, opts: EngineOptions | None = None, launcher=None):
        self.opts = opts = opts or EngineOptions()
        if opts.weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {opts.weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
        self.path = Path(model_path)
        reader = open_gguf(self.path)
        self.cfg = cfg = read_config(self.path, reader)
        names = {t.name for t in reader.tensors}
        missing = [n for n in required_tensors(cfg) if n not in names and n.replace("ffn_down", "ffn_down_t") not in names]
        if missing:
            raise ModelFileError(f"{self.path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
        down_t = [f"blk.{i}.ffn_down_t.weight" for i in range(cfg.n_layers)]
        check_supported_types(self.path, reader, [n for n in required_tensors(cfg) + down_t if n in names])
        try:
            self.tokenizer = GGUFTokenizer.from_reader(reader)
        except ValueError as e:
            raise ModelFileError(f"{self.path}: tokenizer: {e}") from None
        self.chat_template = chat_template_from_reader(reader)
        self.reader = reader
        self.predictors = self._load_predictors(reader)
        cuda = torch.cuda.is_available() and opts.gpu_device in ("auto", "cuda")
        total, n_cpu, per_worker = resolve_threads(opts, cuda)
        share = default_gpu_share(cuda) if opts.gpu_share is None else opts.gpu_share
        if opts.vram_budget_gb is not None and opts.coordinator_share:
            raise ValueError("--coordinator-share goes with the static split, not with --vram-budget")
        if opts.vram_budget_gb is not None:  # hot neurons by activation profile, within the budget
            self.plan, _, self.plan_source = plan_under_budget(
                self.path, cfg.n_layers, cfg.n_ff, cfg.hidden, opts.vram_budget_gb, n_cpu,
                opts.reset_gpu_index, opts.disable_gpu_index, weights=opts.weights)
        else:
            coord = (default_coordinator_share(cuda, n_cpu, per_worker) if opts.coordinator_share is None
                     else opts.coordinator_share)
            self.plan, self.plan_source = static_plan(cfg.n_layers, cfg.n_ff, share, n_cpu, coord), "static"
        self.pool = WorkerPool(self.path, self.plan, cfg.hidden, opts.max_batch, per_worker,
                               opts.gpu_device, opts.transport, launcher=launcher, weights=opts.weights,
                               spin=opts.spin, cores=total, split_lm_head=opts.split_lm_head)
        # While workers spin on their cores, the coordinator computes on the one left to it.
        torch.set_num_threads(max(1, total - self.pool.spinning_workers) if self.pool.spin else total)
        try:
            self.pool.spawn()  # workers start importing while we load attention weights
            self.model = AttentionModel(TensorStore(self.path, reader), cfg, min(opts.ctx, cfg.context_length),
                                        opts.weights)
            self.pool.wait_ready()
        except BaseException:
            self.pool.close()
            raise
        if self.pool.local_head is not None:  # the lm_head's rows are split across processes
            self.model.one_token_head = lambda h: torch.from_numpy(self.pool.run_lm_head(h.numpy()[0]))[None]
        self.last = RunStats()
        self.ffn_observer = None  # calibration hook: (layer, normed FFN input rows, pre-norm rows)
        self.sparse_batches = False  # perplexity: apply thresholds to multi-token batches too
        self.sparsity: float | None = None
        try:
            self.set_sparsity(opts.sparsity)
        except BaseException:
            self.pool.close()
            raise

    def _load_predictors(self, reader) -> Predictors | None:
        p = self.opts.predictor
        if p == "none":
            return None
        if p is not None:
            if self.opts.sparsity is not None:
                raise ValueError("choose one sparsity source: --sparsity (thresholds) or --predictor, not both")
            return Predictors.load(p, self.cfg)
        # A model's own predictors are the default unless thresholds were asked for explicitly.
        if self.opts.sparsity is None and has_predictors(reader):
            return Predictors.load(self.path, self.cfg, reader)
        return None

    def set_sparsity(self, sparsity: float | None) -> None:
        """Use the calibrated thresholds for `sparsity` from now on (None: dense)."""
        if sparsity is not None and self.predictors is not None:
            raise ValueError("predictors are active: threshold sparsity and predictors are exclusive")
        if sparsity is not None:
            path = Path(self.opts.thresholds_file) if self.opts.thresholds_file else None
            self.pool.buffers.thresholds[:] = load_thresholds(self.path, sparsity, path)
        self.sparsity = sparsity

    # ---- FFN through the workers -----------------------------------------------------------

    def _ffn(self, layer: int, x: torch.Tensor, _pre_norm: torch.Tensor) -> torch.Tensor:
        xs = x.numpy()
        if self.ffn_observer is not None:  # (layer, FFN input after ffn_norm, residual before it)
            self.ffn_observer(layer, xs, _pre_norm.numpy())
        # Decoding is sparse when a sparsity or predictors are set; prefill stays dense (a long
        # prompt's tokens together activate nearly every neuron) unless perplexity asks otherwise.
        if self.predictors is not None and (len(xs) == 1 or self.sparse_batches):
            return self._ffn_predicted(layer, xs, _pre_norm)
        sparse = self.sparsity is not None and (len(xs) == 1 or self.sparse_batches)
        step = self.opts.max_batch
        if len(xs) <= step:  # one exchange (every decoded token): no chunking, no extra copy
            self.pool.buffers.x[: len(xs)] = xs
            return torch.from_numpy(self.pool.run_ffn(layer, len(xs), dense=True, threshold=sparse))
        out = np.empty_like(xs)
        for a in range(0, len(xs), step):
            chunk = xs[a:a + step]
            self.pool.buffers.x[: len(chunk)] = chunk
            out[a:a + step] = self.pool.run_ffn(layer, len(chunk), dense=True, threshold=sparse)
        return torch.from_numpy(out)

    def _ffn_predicted(self, layer: int, xs: np.ndarray, pre_norm: torch.Tensor) -> torch.Tensor:
        """One exchange per token: the shared-memory mask holds one active set per call."""
        buf, out = self.pool.buffers, np.empty_like(xs)
        masks = self.predictors.masks(layer, pre_norm)
        for t in range(len(xs)):
            buf.x[:1] = xs[t:t + 1]
            buf.mask[:] = masks[t]
            out[t:t + 1] = self.pool.run_ffn(layer, 1, dense=False)
        return torch.from_numpy(out)

    # ---- public API -------------------------------------------------------------------------

    def reset(self) -> None:
        self.model.reset()

    def perplexity(self, chunks: list[list[int]], progress=None) -> dict:
        """Perplexity of next-token prediction over `chunks`, with this engine's sparsity
        applied to every token (as decoding would), plus the fraction of FFN neurons computed."""
        self.sparse_batches = True
        self.pool.stats.active.clear()
        self.pool.stats.tokens.clear()
        nll, n = 0.0, 0
        try:
            for c in chunks:
                logits = torch.from_numpy(self.forward_logits(c)[:-1]).double()
                lp = torch.log_softmax(logits, dim=-1)
                nll -= float(lp[torch.arange(len(c) - 1), torch.tensor(c[1:])].sum())
                n += len(c) - 1
                if progress:
                    progress(1)
        finally:
            self.sparse_batches = False
        st = self.pool.stats
        computed = sum(st.active.values()) / max(1, sum(st.tokens.values()) * self.cfg.n_ff)
        return {"ppl": float(np.exp(nll / n)), "nll": nll / n, "tokens": n, "active_fraction": computed}

    def forward_logits(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits for every position of `ids`, from a fresh KV cache."""
        self.reset()
        return self.model.forward(list(ids), self._ffn, all_logits=True).numpy()

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stop_at_eos: bool = True) -> Iterator[int]:
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to condition on")
        if len(prompt_ids) + max_tokens > self.model.max_ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + {max_tokens} new tokens exceeds the "
                             f"context size {self.model.max_ctx} (raise --ctx)")
        sampler = Sampler(sampling or SamplingParams())
        self.reset()
        st = self.last = RunStats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        logits = self.model.forward(list(prompt_ids), self._ffn)[-1].numpy()
        st.prefill_s = time.perf_counter() - t0
        eos = self.tokenizer.eos_ids
        for i in range(max_tokens):
            tok = sampler(logits)
            yield tok
            if stop_at_eos and tok in eos:
                return
            if i == max_tokens - 1:
                return
            t1 = time.perf_counter()
            logits = self.model.forward([tok], self._ffn)[-1].numpy()
            dt = time.perf_counter() - t1
            st.decode_s += dt
            st.decode_tokens += 1
            st.token_times.append(dt)

    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        """The user's text wrapped in the model's own chat template (ChatML when it has none)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
        tk = self.tokenizer
        bos = tk.tokens[tk.bos_id] if tk.bos_id is not None else ""
        eos = tk.tokens[tk.eos_id] if tk.eos_id is not None else ""
        return render_chat(self.chat_template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)

    def stats(self) -> dict:
        return {
            "sync_us": list(self.pool.stats.overhead_us),
            "round_trip_us": list(self.pool.stats.round_trip_us),
            "prefill_s": self.last.prefill_s,
            "decode_s": self.last.decode_s,
            "decode_tokens": self.last.decode_tokens,
            "prompt_tokens": self.last.prompt_tokens,
            "weights": self.opts.weights,
            "worker_weight_bytes": [w.weight_bytes for w in self.pool.workers],
            "coordinator_ffn_bytes": self.pool.local_weight_bytes,
        }

    def check_workers(self) -> None:
        """Raise WorkerError if a worker process has died (for callers idle between requests)."""
        self.pool._check_alive()

    def close(self) -> None:
        self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
