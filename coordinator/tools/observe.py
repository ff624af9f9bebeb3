"""The offline tools' one door into the engine, and the one rule for which FFN neurons are active.

The tools (calibrate, profile, train-predictor, perplexity, bench) touch an Engine only through
the functions below: no other module of coordinator/tools/ reads or sets an engine attribute, so
a change of the engine's internals is fixed here and nowhere else.

The rule the tools share: for an FFN input row x, neuron n fires with magnitude
|act(gate[n] · x)| (`gate_activity`), and is active where that exceeds its layer's threshold
(`active`): the calibrated CATS threshold of SwiGLU/GeGLU models, 0 for ReLU models (where
|relu(z)| > 0 is relu(z) > 0). The workers apply the same rule while decoding
(sparsecore.ffn.is_active); calibration chooses the thresholds as quantiles of these magnitudes
(`magnitude_quantiles`).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np

if TYPE_CHECKING:
    import torch

QUANTILE_SAMPLE = 1 << 24  # torch.quantile's input limit: larger inputs are sampled (seeded)

# An observer: (layer, FFN input after ffn_norm (T, hidden), residual before ffn_norm (T, hidden)
# [, the router's input (T, hidden), only where the router scores the layer's input: smallthinker]),
# float32 numpy arrays valid only during the call (copy what you keep).
Observer = Callable[..., None]
# An attention observer: (layer, attention input after attn_norm (T, hidden), attention output
# before the output matrix (T, heads x head_dim)), valid only during the call likewise.
AttentionObserver = Callable[[int, np.ndarray, np.ndarray], None]


# ---- what the engine is ------------------------------------------------------------------------

def config(engine):
    """The model's sparsecore.config.ModelConfig."""
    return engine.cfg


def model(engine):
    """The engine's coordinator.model.transformer.Transformer (its hooks: attn_observer, input_filter, ffn)."""
    return engine.model


def model_path(engine) -> Path:
    return engine.path


def weights_format(engine) -> str:
    """How workers hold FFN weights in memory (protocol.messages.WEIGHT_FORMATS)."""
    return engine.opts.weights


def ffn_neuron_bytes(engine) -> float:
    """Bytes one FFN neuron's gate row, up row and down column take as the processes read them:
    in the file's own blocks with --weights gguf, else in the converted format."""
    cfg = engine.cfg
    if engine.opts.weights != "gguf":
        from ..runtime.placement import neuron_bytes

        return neuron_bytes(cfg.hidden, engine.opts.weights)
    from sparsecore.file_layer import FileLayer

    # Every layer's: a Q4_K_M file holds Q6_K ffn_down in some layers, Q4_K in the others (layer
    # 0's alone counted 1.054x the bytes on the 1.1B shape). PowerInfer files hold down
    # transposed (ffn_down_t): its rows are the columns.
    store = engine.store
    if cfg.routed:  # a neuron of an expert: the stacked tensors over every expert's neurons
        total = sum(int(store.raw(f"blk.{i}.{n}.weight").n_bytes) for i in range(cfg.n_layers)
                    for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
        return total / (cfg.n_ff * cfg.n_experts * cfg.n_layers)
    total = sum(int(store.info(n).n_bytes) for i in range(cfg.n_layers)
                for n in (f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight", FileLayer.down_name(store, i)))
    return total / (cfg.n_ff * cfg.n_layers)


def sparse_method(engine) -> str:
    """How the engine's sparsity level skips weights (EngineOptions.sparse_method)."""
    return engine.opts.sparse_method


def input_thresholds(engine) -> tuple[list[list[float]], float] | None:
    """The engine's input-sparsity thresholds at its level: (per layer, one per INPUT_SITES; the
    lm_head input's), or None when it decodes densely or by another method."""
    if engine.sparsity is None or engine.opts.sparse_method != "input":
        return None
    from ..runtime.model_files import load_input_level

    path = Path(engine.opts.thresholds_file) if engine.opts.thresholds_file else None
    return load_input_level(engine.path, engine.sparsity, path)


def predictors(engine):
    """The engine's activation predictors (coordinator.model.predictor.Predictors), or None."""
    return engine.predictors


def worker_layout(engine) -> dict:
    """Cores, worker processes and their devices, and the coordinator's own share of FFN neurons."""
    workers, own, cfg = engine.pool.workers, engine.ffn.own, engine.cfg
    share = own.n_neurons / (cfg.n_layers * cfg.n_ff) if own is not None else 0.0
    return dict(threads=engine.opts.threads, cpu_workers=len(workers) - 1,
                devices=[w.device for w in workers], coordinator_ffn_share=share)


def coordinator_bytes_per_token(engine) -> int:
    """Weights the coordinator reads per decoded token: attention and norms of every layer,
    the final norm, the lm_head, and one embedding row."""
    return engine.model.bytes_per_token()


# ---- running it ----------------------------------------------------------------------------------

def fc1_readers(engine, predictors) -> int:
    """How many processes read `predictors`' fc1 per token: each that scores its own neurons
    (SparseFfn.shard_predictors), else the coordinator alone."""
    ffn = getattr(engine, "ffn", None)
    if ffn is None or ffn.shard_predictors is not predictors:
        return 1
    return len({int(s) for part in ffn.sum_slots for s in part})


def twin_counts(engine, tokens: int = 0) -> tuple[int, int]:
    """(bytes the coordinator's input-major twins read since the last call, over `tokens`
    decoded tokens; their bytes), the counters zeroed: a decoded token's share of the twinned
    matrices it read is the first over the second per token (every process reads about the same
    share: the same inputs, or its own heads' and neurons' of the same layer). A twin whose
    threshold word is negative (a site or the lm_head left dense, as with a thresholds file
    without head levels) read its matrix's rows in full at each of the tokens: it counts as
    read whole, not as skipped."""
    twins = getattr(engine, "twins", None)
    if twins is None:
        return 0, 0
    read = 0
    for m, w in zip(twins.matrices, twins.words):
        counts = m.reset_twin_counts()
        read += m.twin_bytes_read(*counts) if w[0] >= 0 else tokens * m.twin_bytes
    return read, sum(m.twin_bytes for m in twins.matrices)


def twinned_bytes(engine) -> int:
    """Bytes of the matrices every process's twins copy (the file's: the memory plan's twins row)."""
    return engine.memory.twins


def set_sparsity_source(engine, sparsity: float | None, predictors=None) -> None:
    """Decode with calibrated thresholds at `sparsity`, or with `predictors`, or densely (both None)."""
    engine.predictors = predictors
    engine.set_sparsity(sparsity)


@contextlib.contextmanager
def head_replaced(engine, head: Callable) -> Iterator[None]:
    """Within the block the model's logits come from head(h) (h: the final normed hidden states,
    (T, hidden) float32 array -> (T, n_vocab) array) instead of the engine's lm_head; a soft cap
    still applies after it."""
    model = engine.model
    outer = model.head
    capped = hasattr(outer, "cap")  # coordinator.model.transformer._SoftCapped around the lm_head
    if capped:
        inner, outer.head = outer.head, head
    else:
        model.head = head
    try:
        yield
    finally:
        if capped:
            outer.head = inner
        else:
            model.head = outer


def dense_run(engine, chunks: Iterable[list[int]], observer: Observer, progress=None,
              attention_observer: AttentionObserver | None = None, head_observer=None) -> int:
    """Run each chunk of token ids through the dense model (a fresh KV cache per chunk), calling
    `observer` with every layer's FFN input (and `attention_observer` with its attention's input
    and output, `head_observer` with the lm_head's input, (T, hidden) float32); the engine's
    sparsity and observers are restored afterwards. `progress(1)` after each chunk. Returns the
    number of tokens run."""
    with contextlib.ExitStack() as stack:
        if head_observer is not None:
            head = engine.head
            stack.enter_context(head_replaced(engine, lambda h: (head_observer(h), head(h))[1]))
        return _dense_run(engine, chunks, observer, progress, attention_observer)


def _dense_run(engine, chunks, observer, progress, attention_observer) -> int:
    old_sparsity, old_observer = engine.sparsity, engine.ffn.observer
    engine.set_sparsity(None)
    engine.ffn.observer = observer
    engine.model.attn_observer = attention_observer
    n = 0
    try:
        for c in chunks:
            engine.forward_logits(c)
            n += len(c)
            if progress:
                progress(1)
    finally:
        engine.ffn.observer = old_observer
        engine.model.attn_observer = None
        engine.set_sparsity(old_sparsity)
    return n


def all_logits(engine, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits (len(ids), vocab) from a fresh KV cache, with the engine's sparsity
    applied as it is set (see `sparse_batches`)."""
    return engine.forward_logits(ids)


@contextlib.contextmanager
def sparse_batches(engine) -> Iterator[None]:
    """Within the block the engine's thresholds or predictors apply to every token of a
    multi-token batch too, as decoding would (by default prefill is dense)."""
    engine.ffn.sparse_batches = True
    try:
        yield
    finally:
        engine.ffn.sparse_batches = False


def greedy(engine, prompt: list[int], n_tokens: int) -> Iterator[int]:
    """Greedy continuation: the prompt's next token, then decoded ones, `n_tokens` in all (EOS
    does not stop it), one target step each: the tools time and count single-token steps, so
    speculative decoding stays off here."""
    from ..runtime.sampling import SamplingParams

    return engine.generate(prompt, max_tokens=n_tokens, sampling=SamplingParams(temperature=0.0),
                           stop_at_eos=False, speculate=False)


class FfnMeter:
    """What the engine's FFN exchanges did since the meter was made: per exchange the round trip
    and the synchronization overhead (round trip minus the slowest worker's compute), and the
    fraction of FFN neurons computed per token and layer."""

    def __init__(self, engine):
        self._stats = st = engine.ffn.stats
        cfg = engine.cfg  # a routed layer's token can compute its k experts' neurons
        self._n_ff = cfg.n_ff * (cfg.n_experts_used if cfg.routed else 1)
        self._exchanges = len(st.round_trip_us)
        self._active = sum(st.active.values())
        self._tokens = sum(st.tokens.values())

    def round_trip_us(self) -> list[float]:
        return list(self._stats.round_trip_us[self._exchanges:])

    def overhead_us(self) -> list[float]:
        return list(self._stats.overhead_us[self._exchanges:])

    def active_fraction(self) -> float:
        st = self._stats
        tokens = sum(st.tokens.values()) - self._tokens
        return (sum(st.active.values()) - self._active) / max(1, tokens * self._n_ff)


# ---- the gate-activity rule ----------------------------------------------------------------------

def _torch():
    """torch and the FFN's activations (sparsecore.ffn), imported by the rule's functions on first
    use: a tool that only runs and measures the engine (bench) holds what `generate` holds."""
    import torch

    from sparsecore import ffn

    return torch, ffn


def gate_activity(gate: torch.Tensor, x, activation: str) -> torch.Tensor:
    """|act(x @ gate.T)|, shape (rows of x, neurons): how strongly each neuron fires per row."""
    torch, ffn = _torch()
    return ffn.ACTIVATIONS[activation](torch.as_tensor(x) @ gate.T).abs()


def active(mags: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which neurons are active: gate activity above the layer's threshold (0 for ReLU models),
    the rule the workers apply while decoding."""
    return _torch()[1].is_active(mags, threshold)


def magnitude_quantiles(mags: torch.Tensor, qs) -> torch.Tensor:
    """Quantiles `qs` of all the magnitudes (a seeded sample of QUANTILE_SAMPLE when there are more)."""
    torch = _torch()[0]
    flat = mags.flatten()
    if flat.numel() > QUANTILE_SAMPLE:
        flat = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:QUANTILE_SAMPLE]]
    return torch.quantile(flat, torch.as_tensor(qs, dtype=torch.float32))


class GateActivity:
    """`gate_activity` for the engine's model, layer by layer. `keep`: hold every layer's gate
    matrix after its first use (for per-chunk observers), else read it from the file each time
    (memory bounded by one layer's gate)."""

    def __init__(self, engine, keep: bool = False):
        self._store = engine.store
        self.activation, self.gate_mode = engine.cfg.activation, engine.cfg.ffn_gate
        self._kept: dict[int, torch.Tensor] | None = {} if keep else None

    def gate(self, layer: int) -> torch.Tensor:
        if self._kept is not None and layer in self._kept:
            return self._kept[layer]
        g = _torch()[0].from_numpy(self._store.matrix(f"blk.{layer}.ffn_gate.weight"))
        if self._kept is not None:
            self._kept[layer] = g
        return g

    def head(self) -> torch.Tensor:
        """The lm_head (n_vocab, hidden), dequantized (tied: the embedding), read from the file."""
        name = "output.weight" if self._store.has("output.weight") else "token_embd.weight"
        return _torch()[0].from_numpy(self._store.matrix(name))

    def down(self, layer: int) -> torch.Tensor:
        """The layer's down matrix (hidden, n_ff), dequantized (PowerInfer files hold it transposed)."""
        if self._store.has(f"blk.{layer}.ffn_down_t.weight"):
            return self.matrix(layer, "ffn_down_t").T.contiguous()
        return self.matrix(layer, "ffn_down")

    def matrix(self, layer: int, name: str) -> torch.Tensor:
        """Another FFN matrix of the layer ("ffn_up"), dequantized, read from the file each time."""
        return _torch()[0].from_numpy(self._store.matrix(f"blk.{layer}.{name}.weight"))

    def hidden(self, layer: int, x) -> torch.Tensor:
        """The FFN's hidden activation h (down's input) for the layer's dense FFN inputs x (rows,
        hidden): act(x @ gate.T) and up's product combined as the model's gate mode has it."""
        torch, ffn = _torch()
        xt = torch.as_tensor(x)
        up = None if self.gate_mode == "none" else self.matrix(layer, "ffn_up")
        return ffn.combine(ffn.ACTIVATIONS[self.activation](xt @ self.gate(layer).T), xt, up, self.activation,
                           self.gate_mode)

    def __call__(self, layer: int, x) -> torch.Tensor:
        return gate_activity(self.gate(layer), x, self.activation)


class ExpertActivity:
    """`gate_activity` for a routed model's experts: the FFN inputs routed as every process routes
    them (sparsecore.shard.route, the token step's kernel), then |act(gate_e x)| of the rows each
    expert e was chosen for: the magnitudes a CATS threshold of that expert is compared with
    (sparsecore/kernels/moe_step.c moe_token)."""

    def __init__(self, engine):
        cfg = engine.cfg
        self._store = engine.store
        self.activation, self.n_experts, self.k, self.renorm = (cfg.activation, cfg.n_experts, cfg.n_experts_used,
                                                                cfg.expert_norm)

    def route(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The experts each row of x (T, hidden), the router's inputs, goes to: (T, k) int32 (the
        same for softmax and sigmoid gating: both keep the logits' order)."""
        from sparsecore.kernels import FileMatrix
        from sparsecore.experts import route

        router = FileMatrix(self._store.info(f"blk.{layer}.ffn_gate_inp.weight"))
        return route(router, x, self.k, self.renorm)[0]

    def __call__(self, layer: int, e: int, x) -> torch.Tensor:
        """|act(x @ gate_e.T)| (rows of x, expert e's neurons), gate_e dequantized from the file."""
        from sparsecore.kernels import FileMatrix

        gate = FileMatrix(self._store.expert(f"blk.{layer}.ffn_gate_exps.weight", e)).dequantize()
        return gate_activity(_torch()[0].from_numpy(gate), x, self.activation)
