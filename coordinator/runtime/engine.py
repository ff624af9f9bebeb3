"""The coordinator's engine: one model, its worker processes, and the token loop. Engine runs
what coordinator/runtime/engine_build.py builds (EngineBuilder: the options checked, the file read, the
neurons placed, the memory planned, the workers started, the model built); its options are
coordinator/runtime/engine_options.py's EngineOptions, re-exported here.

    with Engine(path, EngineOptions()) as eng:
        for tok in eng.generate(eng.tokenizer.encode("Hello"), max_tokens=32): ...
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from protocol.shm_layout import INPUT_SITES

from .decode_plan import DecodePlan
from .engine_build import EngineBuilder, close_started, load_level
from .engine_options import EngineOptions  # noqa: F401 (re-exported: callers import it from here)
from .model_files import load_expert_thresholds, thresholds_path
from .sampling import Sampler, SamplingParams, pick_next
from . import speculative
from .speculative import SpecStats, Speculator

if TYPE_CHECKING:
    from ..model.predictor import Predictors


@dataclass
class RunStats:
    prompt_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    spec: SpecStats | None = None  # speculative decoding's counts (None: it was off)
    # a routed model's route counts when the run began (SharedBuffers.route_counts), to count this run's
    routes_before: np.ndarray | None = None


def routed_shares(counts: np.ndarray, shards, dealt: Iterable[int] = ()) -> dict:
    """The measured routed share of each process from `counts` (n_slots, n_layers, E: the chosen
    experts each process computed, SharedBuffers.route_counts, or a difference of two): every
    (layer, expert) has an owner, and each owner counts every choice of it, so the largest count
    over the processes is how often the expert was chosen; where the slots `dealt` deal each
    token's experts among them (placement.deal_experts), each choice is counted by one of them,
    and their sum is. Returns {"routes": the routed (token, expert) choices in all, "processes":
    per slot its role, worker id, the choices it computed and their share, "dealt": the dealing
    slots}; `shards`: the plan's, by slot."""
    dealt = sorted(dealt)
    whole = np.delete(counts, dealt, axis=0)
    chosen = whole.max(axis=0) if len(whole) else np.zeros(counts.shape[1:], counts.dtype)
    if dealt:
        chosen = np.maximum(chosen, counts[dealt].sum(axis=0))
    routes = int(chosen.sum()) if len(counts) else 0
    per = []
    for slot, sh in enumerate(shards):
        mine = int(counts[slot].sum())
        per.append({"role": sh.role, "worker_id": sh.worker_id, "routes": mine,
                    "share": mine / routes if routes else 0.0})
    return {"routes": routes, "processes": per, "dealt": dealt}


class Engine:
    """Run a model: the token loop over what EngineBuilder planned and started."""

    def __init__(self, model_path: str | os.PathLike, opts: EngineOptions | None = None, launcher=None,
                 plan_only: bool = False):
        """plan_only: stop once the placement and the memory plan (self.memory) are made, before
        the check that refuses a plan that does not fit and before any process or cache exists
        (`sparseinfer info`)."""
        built = EngineBuilder(model_path, opts or EngineOptions())
        self.opts = built.opts  # sparsity None where the input-major twins do not fit
        self.path, self.cfg, self.chat_template = built.path, built.cfg, built.chat_template
        self.input_major, self.row_layout = built.input_major, built.row_layout
        self.store, self.plan, self.plan_source, self.memory = built.store, built.plan, built.plan_source, \
            built.memory
        self.expert_placement = built.expert_placement  # a routed model's under --vram-budget, else None
        self.dealt = tuple(built.deal)  # the slots that deal each token's experts among them
        if plan_only:
            self.tokenizer = built.load_tokenizer()
            return
        built.start(launcher)  # closes what it made if it fails; builds the tokenizer while the workers load
        self.tokenizer = built.load_tokenizer()
        self.kv_pool, self.pool, self.ffn, self.head, self.model, self.twins = \
            built.kv_pool, built.pool, built.ffn, built.head, built.model, built.twins
        try:
            self.last = RunStats()
            self.sparsity: float | None = None
            self._told_dense_head = False
            self.set_sparsity(self.opts.sparsity)
            self.spec = self._speculator()
        except BaseException:
            self.close()
            raise

    @property
    def decode_plan(self) -> DecodePlan:
        """Which path decoded tokens take, and why (coordinator/runtime/decode_plan.py)."""
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

    def _speculator(self) -> Speculator | None:
        """Speculative decoding as opts.spec asks (coordinator/runtime/speculative.py); a draft
        model runs as an engine of its own, a worker beside ours."""
        mode = self.opts.spec
        # a layer whose attention takes torch's path computes a run of rows in other blocks than
        # one row: a checked draft's logits could then differ from plain decoding's last bits
        if mode == "off" or not all(step is not None for step in self.model.native):
            return None
        if mode == "draft":
            from dataclasses import replace

            from .speculative import DraftModel

            d = replace(self.opts, spec="off", draft_model=None, cpu_workers=1, sparsity=None, predictor="none",
                        ctx=self.model.max_ctx)
            draft = Engine(self.opts.draft_model, d)
            try:
                return Speculator("draft", DraftModel(draft, self.tokenizer))
            except BaseException:
                draft.close()
                raise
        return Speculator(mode)

    def _thresholds(self, sparsity: float) -> list:
        """The calibrated thresholds of `sparsity` by the engine's method (engine_build.load_level)."""
        return load_level(self.path, self.opts, sparsity)

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
        self.pool.buffers.expert_thresholds[:] = -1.0
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
            if head < 0 and not self._told_dense_head:  # a thresholds file from before lm_head levels
                self._told_dense_head = True
                print(f"note: {self.path.name}'s thresholds have no lm_head levels (an older calibration): the "
                      f"lm_head reads densely; `sparseinfer calibrate -m {self.path}` again skips its inputs too",
                      file=sys.stderr)
            self.ffn.set_thresholds(None)  # the steps are dense to the protocol: the twins skip
        else:
            per_layer = self._thresholds(sparsity)
            self.ffn.set_thresholds(per_layer)
            self._set_expert_thresholds(sparsity, per_layer)
            words[:] = -1.0
            if self.input_major:  # down's twins skip the neurons CATS zeroed (h == 0)
                words[:, INPUT_SITES.index("ffn_h")] = 0.0
        self.sparsity = sparsity

    def _set_expert_thresholds(self, sparsity: float, per_layer: list[float]) -> None:
        """A routed model's CATS thresholds per expert into shared memory, where every process
        holding expert rows reads its layer's row at each threshold step (sparsecore/
        expert_thresholds.py); each expert takes its layer's threshold where the file has none."""
        table = self.pool.buffers.expert_thresholds
        if not table.size:
            return
        table[:] = np.asarray(per_layer, dtype=np.float32)[:, None]
        path = Path(self.opts.thresholds_file) if self.opts.thresholds_file else None
        experts = load_expert_thresholds(self.path, sparsity, path)
        if experts is not None:
            if np.shape(experts) != table.shape:
                raise ValueError(f"{path or thresholds_path(self.path)}: expert thresholds of shape "
                                 f"{np.shape(experts)}, the model has {table.shape}: calibrate again")
            table[:] = np.asarray(experts, dtype=np.float32)

    # ---- public API -------------------------------------------------------------------------

    def reset(self) -> None:
        self.model.cache.reset()

    def check_workers(self) -> None:
        """Raise WorkerError naming a worker that failed or died (also while idle)."""
        self.pool.check_alive()

    def forward_logits(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits for every position of `ids`, from a fresh KV cache."""
        self.reset()
        return self.model.forward(list(ids), all_logits=True)

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stop_at_eos: bool = True, constraint=None, speculate: bool = True) -> Iterator[int]:
        """The tokens after `prompt_ids`, one at a time. `constraint`: a
        structured_output.Constraint the reply follows (it ends when the grammar is complete).
        speculate: decode speculatively where the engine does (opts.spec); the tools that time
        or count single-token steps turn it off."""
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to condition on")
        if len(prompt_ids) + max_tokens > self.model.max_ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + {max_tokens} new tokens exceeds the "
                             f"context size {self.model.max_ctx} (raise --ctx)")
        sampler = Sampler(sampling or SamplingParams())
        self.reset()
        st = self.last = RunStats(prompt_tokens=len(prompt_ids), routes_before=self._route_counts())
        t0 = time.perf_counter()
        logits = self.model.forward(list(prompt_ids))[-1]
        st.prefill_s = time.perf_counter() - t0
        eos = self.tokenizer.eos_ids
        if speculate and self.spec is not None:
            st.spec = SpecStats()
            before = self.spec.stats
            self.spec.stats = st.spec  # this run's counts (the server's scheduler keeps its own)
            try:
                yield from speculative.generate(self.model, self.spec, logits, prompt_ids, max_tokens, sampler, eos,
                                                stop_at_eos, constraint, st)
            finally:
                self.spec.stats = before
            return
        history = list(prompt_ids)  # what the repeat/presence/frequency penalties look back on
        for i in range(max_tokens):
            pick = pick_next(logits, sampler, history, eos, stop_at_eos, constraint)  # the scheduler's step too
            tok = pick.token
            yield tok
            if pick.end is not None or i == max_tokens - 1:
                return
            t1 = time.perf_counter()
            logits = self.model.forward([tok])[-1]
            dt = time.perf_counter() - t1
            st.decode_s += dt
            st.decode_tokens += 1
            st.token_times.append(dt)

    def embed(self, texts: list[list[int]]) -> np.ndarray:
        """Unit-length embedding vectors of token-id texts, (len(texts), hidden) float32, pooled
        as the model's metadata says (coordinator/runtime/embedding.py)."""
        from .embedding import Embedder

        if getattr(self, "embedder", None) is None:
            self.embedder = Embedder.for_engine(self)
        self.embedder.check(texts, self.cfg.vocab_size)
        return self.embedder(texts)

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
        from ..text.chat_template import render_chat  # jinja2: imported by the runs that render a chat

        return render_chat(self.chat_template, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos,
                           **variables)

    def encode_chat(self, messages: list[dict], **variables) -> list[int]:
        """Token ids of a rendered conversation: no second BOS when the template wrote one."""
        text = self.render_messages(messages, **variables)
        tk = self.tokenizer
        has_bos = tk.bos_id is not None and text.startswith(tk.tokens[tk.bos_id])
        return tk.encode(text, add_bos=False if has_bos else None)

    def _route_counts(self) -> np.ndarray | None:
        """A copy of every process's route counts (a routed model), else None."""
        return self.pool.buffers.route_counts.copy() if self.cfg.routed else None

    def routed_work(self, since: np.ndarray | None = None) -> dict | None:
        """A routed model's measured routed share per process (routed_shares) since `since` (a
        copy of the route counts; None: since the engine started), with the share placement
        predicted for the GPU worker under --vram-budget; None for a dense model."""
        now = self._route_counts()
        if now is None:
            return None
        out = routed_shares(now if since is None else now - since, self.plan.shards, self.dealt)
        out["predicted_share"] = None if self.expert_placement is None else self.expert_placement["predicted_share"]
        return out

    def stats(self) -> dict:
        return {
            "routed": None if self.last.routes_before is None else self.routed_work(self.last.routes_before),
            "sync_us": list(self.ffn.stats.overhead_us),
            "round_trip_us": list(self.ffn.stats.round_trip_us),
            "prefill_s": self.last.prefill_s,
            "decode_s": self.last.decode_s,
            "decode_tokens": self.last.decode_tokens,
            "prompt_tokens": self.last.prompt_tokens,
            "weights": self.opts.weights,
            "worker_weight_bytes": [w.weight_bytes for w in self.pool.workers],
            "coordinator_ffn_bytes": self.ffn.own.nbytes if self.ffn.own is not None else 0,
            "spec": self.last.spec,
        }

    def close(self) -> None:
        if getattr(self, "spec", None) is not None:
            self.spec.close()
        close_started(getattr(self, "pool", None), getattr(self, "model", None), getattr(self, "kv_pool", None))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
