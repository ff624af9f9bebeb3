"""Activation profiles: how often each FFN neuron of each layer is active.

`sparseinfer profile` runs the dense model over the calibration text (coordinator.tools.corpus)
and counts, per layer and neuron, the fraction of tokens for which the neuron is active (the
rule of coordinator.tools.observe):
  - SwiGLU (silu) models: |act(gate x)| > the layer's calibrated CATS threshold at sparsity S
    (`<model>.thresholds.json`, written by `sparseinfer calibrate`); without calibrated
    thresholds, the per-layer quantile S of |act(gate x)| on this same text is used instead;
  - ReLU models: relu(gate x) > 0.
Placement under a VRAM budget (coordinator.runtime.placement) puts the most frequently active
neurons on the GPU worker.

The result is `<model>.profile.npz` (coordinator.runtime.model_files: one float32 array of frequencies
in [0, 1] per layer and a JSON metadata document). A PNG beside it plots the sorted frequencies
per layer on log-log axes (the hot/cold split) and the share of activations covered by the
hottest neurons.

PowerInfer ships its profiles as a directory `activation/activation_N.pt` of torch tensors
(activation counts per neuron); `load_powerinfer_activations` reads them into the same
per-layer arrays, ordered by N as a number (PowerInfer's own loader sorts file names, which
puts activation_10 before activation_2).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import torch

from ..runtime.model_files import PROFILE_FORMAT, Profile
from . import observe

DEFAULT_SPARSITY = 0.2  # the default operating point of SwiGLU models
FLUSH_BYTES = 256 << 20  # FFN inputs buffered before they are turned into counts


class ActivationCounter:
    """Turns FFN inputs (an observe.dense_run observer) into per-neuron activation counts.

    Inputs are buffered per layer and converted in batches, one gate matrix at a time, so
    memory stays bounded by FLUSH_BYTES plus one layer's gate matrix. With `thresholds` None
    (SwiGLU without calibration), each layer's threshold is the `sparsity` quantile of
    |act(gate x)| over the first batch of that layer's inputs."""

    def __init__(self, gates: observe.GateActivity, n_layers: int, n_ff: int,
                 thresholds: list[float] | None, sparsity: float):
        self.gates, self.n_layers, self.n_ff = gates, n_layers, n_ff
        self.activation, self.sparsity = gates.activation, sparsity
        self.thresholds = None if thresholds is None else list(thresholds)
        self.auto = [None] * n_layers  # thresholds derived on the fly
        self.counts = [np.zeros(n_ff, dtype=np.int64) for _ in range(n_layers)]
        self.tokens = [0] * n_layers
        self._buf: dict[int, list[np.ndarray]] = {i: [] for i in range(n_layers)}
        self._buffered = 0

    def __call__(self, layer: int, x, *_rest) -> None:
        """The observer: (layer, normalized FFN input rows, pre-norm rows)."""
        x = np.asarray(x, dtype=np.float32)
        self._buf[layer].append(x.copy())
        self._buffered += x.nbytes
        if self._buffered >= FLUSH_BYTES:
            self.flush()

    def threshold(self, layer: int, mags: torch.Tensor) -> float:
        if self.activation == "relu":
            return 0.0
        if self.thresholds is not None:
            return float(self.thresholds[layer])
        if self.auto[layer] is None:
            self.auto[layer] = float(observe.magnitude_quantiles(mags, [self.sparsity])[0])
        return self.auto[layer]

    def flush(self) -> None:
        for layer in range(self.n_layers):
            rows = self._buf[layer]
            if not rows:
                continue
            x = np.concatenate(rows)
            self._buf[layer] = []
            mags = self.gates(layer, x)
            self.counts[layer] += observe.active(mags, self.threshold(layer, mags)).sum(dim=0).numpy()
            self.tokens[layer] += len(x)
        self._buffered = 0

    def frequencies(self) -> list[np.ndarray]:
        self.flush()
        return [(c / max(1, t)).astype(np.float32) for c, t in zip(self.counts, self.tokens)]

    def used_thresholds(self) -> list[float]:
        if self.activation == "relu":
            return [0.0] * self.n_layers
        return list(self.thresholds) if self.thresholds is not None else [float(t or 0.0) for t in self.auto]


class RouteCounter:
    """A routed model's observer: how often each expert of each layer is chosen, each FFN input
    routed by the engine's own kernel (sparsecore.shard.route) over the file's router."""

    def __init__(self, store, cfg):
        from sparsecore.experts import router_bias
        from sparsecore.kernels import FileMatrix

        self.routers = [FileMatrix(store.info(f"blk.{i}.ffn_gate_inp.weight")) for i in range(cfg.n_layers)]
        self.k, self.renormalize = cfg.n_experts_used, cfg.expert_norm
        # as the layers route: the model's gating (gpt-oss's picks by the logits alone), its router bias
        self.gating = cfg.expert_gating
        self.biases = [router_bias(store, i, cfg) for i in range(cfg.n_layers)]
        self.counts = np.zeros((cfg.n_layers, cfg.n_experts), np.int64)
        self.tokens = np.zeros(cfg.n_layers, np.int64)

    def __call__(self, layer: int, x, pre_norm=None, router_in=None) -> None:
        """x: the FFN's inputs; router_in: the layer's, where the router scores those (smallthinker).
        The experts chosen do not depend on the gating (softmax and sigmoid keep the logits' order)."""
        from sparsecore.experts import route

        scored = np.asarray(x if router_in is None else router_in, dtype=np.float32)
        ids, _ = route(self.routers[layer], scored, self.k, self.renormalize, gating=self.gating,
                       bias=self.biases[layer])
        np.add.at(self.counts[layer], ids.reshape(-1), 1)
        self.tokens[layer] += len(ids)

    def frequencies(self) -> list[np.ndarray]:
        """Per layer, the share of tokens routed to each expert (a layer's sum: k)."""
        return [(c / max(1, t)).astype(np.float32) for c, t in zip(self.counts, self.tokens)]


def collect(engine, chunks, sparsity: float = DEFAULT_SPARSITY, thresholds: list[float] | None = None) -> Profile:
    """Run the dense engine over `chunks` (lists of token ids) and count active neurons, or for
    a routed model (MoE) how often each expert is chosen (`unit` "expert" in the metadata: a
    layer's array then has one frequency per expert, summing to the experts a token uses).
    `thresholds`: per-layer calibrated thresholds (SwiGLU); None derives them on the fly."""
    cfg = observe.config(engine)
    path = observe.model_path(engine)
    if cfg.routed:
        counter = RouteCounter(engine.store, cfg)
        t0 = time.perf_counter()
        n_tokens = observe.dense_run(engine, chunks, counter)
        return Profile(counter.frequencies(), {
            "format": PROFILE_FORMAT, "model": path.name, "model_bytes": path.stat().st_size, "unit": "expert",
            "rule": "the router's top k, as the engine routes", "tokens": n_tokens, "n_layers": cfg.n_layers,
            "n_experts": cfg.n_experts, "experts_used": cfg.n_experts_used,
            "seconds": round(time.perf_counter() - t0, 1), "source": "sparseinfer profile"})
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    if thresholds is not None and len(thresholds) != cfg.n_layers:
        raise ValueError(f"{len(thresholds)} thresholds for {cfg.n_layers} layers")
    counter = ActivationCounter(observe.GateActivity(engine), cfg.n_layers, cfg.n_ff, thresholds, sparsity)
    t0 = time.perf_counter()
    n_tokens = observe.dense_run(engine, chunks, counter)
    freqs = counter.frequencies()
    if cfg.activation == "relu":
        rule = "relu(gate x) > 0"
    else:
        rule = "|act(gate x)| > calibrated threshold" if thresholds is not None else \
            "|act(gate x)| > per-layer quantile of this text"
    meta = {
        "format": PROFILE_FORMAT,
        "model": path.name,
        "model_bytes": path.stat().st_size,
        "activation": cfg.activation,
        "sparsity": None if cfg.activation == "relu" else sparsity,
        "rule": rule,
        "thresholds": counter.used_thresholds(),
        "tokens": n_tokens,
        "n_layers": cfg.n_layers,
        "n_ff": cfg.n_ff,
        "seconds": round(time.perf_counter() - t0, 1),
        "source": "sparseinfer profile",
    }
    return Profile(freqs, meta)


# ---- PowerInfer's activation counts -------------------------------------------------------------

def load_powerinfer_activations(directory: Path) -> list[np.ndarray]:
    """PowerInfer's `activation_N.pt` files (one 1-D tensor of activation counts per layer),
    ordered by N as a number. Loaded with weights_only=True: no code in the file runs."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory of activation_N.pt files")
    found = {}
    for p in directory.iterdir():
        m = re.fullmatch(r"activation_(\d+)\.pt", p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        raise ValueError(f"{directory}: no activation_N.pt files")
    if sorted(found) != list(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - set(found))
        raise ValueError(f"{directory}: activation files are not numbered 0..N-1 (missing {missing[:5]})")
    out = []
    for i in range(len(found)):
        t = torch.load(found[i], map_location="cpu", weights_only=True)
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"{found[i]}: expected a 1-D tensor of per-neuron counts")
        out.append(t.detach().to(torch.float32).numpy().copy())
    if len({len(f) for f in out}) != 1:
        raise ValueError(f"{directory}: layers have different neuron counts {sorted({len(f) for f in out})}")
    return out


def profile_from_powerinfer(directory: Path, model: Path | None = None, cfg=None) -> Profile:
    """A Profile from PowerInfer's activation counts. Placement only needs relative
    frequencies; counts are scaled by the largest count so that values lie in [0, 1]."""
    counts = load_powerinfer_activations(directory)
    if cfg is not None and (len(counts) != cfg.n_layers or len(counts[0]) != cfg.n_ff):
        raise ValueError(f"{directory}: {len(counts)} layers x {len(counts[0])} neurons, but the model has "
                         f"{cfg.n_layers} x {cfg.n_ff}")
    top = max(float(c.max()) for c in counts)
    scale = top if top > 1.0 else 1.0
    meta = {
        "format": PROFILE_FORMAT,
        "model": Path(model).name if model else None,
        "model_bytes": Path(model).stat().st_size if model else None,
        "activation": cfg.activation if cfg is not None else None,
        "sparsity": None,
        "rule": "PowerInfer activation counts / largest count",
        "scale": scale,
        "n_layers": len(counts),
        "n_ff": len(counts[0]),
        "source": f"powerinfer:{directory}",
    }
    return Profile([(c / scale).astype(np.float32) for c in counts], meta)


# ---- plot ----------------------------------------------------------------------------------------

def plot_profile(profile: Profile, path: Path, title: str | None = None) -> Path:
    """Left: each layer's frequencies sorted high to low against rank, log-log (a straight-ish
    fall-off is the power law PowerInfer exploits). Right: the share of a layer's expected
    activations covered by its hottest x% of neurons (the curve a VRAM budget moves along)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import cm
    from matplotlib.colors import Normalize

    n = profile.n_layers
    cmap, norm = cm.viridis, Normalize(0, max(1, n - 1))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.4), dpi=110, layout="constrained")
    for i, f in enumerate(profile.freqs):
        s = np.sort(np.asarray(f, dtype=np.float64))[::-1]
        rank = np.arange(1, len(s) + 1)
        pos = s > 0
        ax1.loglog(rank[pos], s[pos], color=cmap(norm(i)), lw=1.0, alpha=0.85)
        total = s.sum()
        cov = np.concatenate([[0.0], np.cumsum(s) / total]) if total > 0 else np.zeros(len(s) + 1)
        ax2.plot(np.linspace(0, 100, len(s) + 1), 100 * cov, color=cmap(norm(i)), lw=1.0, alpha=0.85)
    ax1.set_xlabel("neuron rank within layer (hottest first)")
    ax1.set_ylabel("activation frequency")
    ax1.set_title("sorted activation frequency per layer (log-log)")
    ax1.grid(True, which="both", alpha=0.25)
    ax2.plot([0, 100], [0, 100], color="grey", ls="--", lw=0.8, label="uniform (no hot neurons)")
    ax2.set_xlabel("hottest neurons of the layer (%)")
    ax2.set_ylabel("expected activations covered (%)")
    ax2.set_title("coverage by the hottest neurons")
    ax2.set_xlim(0, 100)
    ax2.set_ylim(0, 100)
    ax2.grid(True, alpha=0.25)
    ax2.legend(loc="lower right", fontsize=8)
    sm = cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=[ax1, ax2], label="layer", fraction=0.03)
    m = profile.meta
    sub = f"{m.get('tokens', '?')} tokens, rule: {m.get('rule', '?')}"
    if m.get("sparsity") is not None:
        sub += f", sparsity {m['sparsity']:.2f}"
    fig.suptitle(f"{title or m.get('model') or 'activation profile'}\n{sub}", fontsize=10)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def summary_lines(profile: Profile) -> list[str]:
    """Per layer: mean frequency and the share of activations its hottest 10% / 20% cover (a
    routed model: the share of routes its most-routed quarter of experts takes)."""
    out = []
    if profile.meta.get("unit") == "expert":
        for i, f in enumerate(profile.freqs):
            s = np.sort(f.astype(np.float64))[::-1]
            q = s[: max(1, len(s) // 4)].sum() / (s.sum() or 1.0)
            out.append(f"layer {i:3d}: most-routed quarter of {len(s)} experts takes {100 * q:5.1f}% of the routes")
        return out
    for i, f in enumerate(profile.freqs):
        s = np.sort(f.astype(np.float64))[::-1]
        tot = s.sum() or 1.0
        c10 = s[: max(1, len(s) // 10)].sum() / tot
        c20 = s[: max(1, len(s) // 5)].sum() / tot
        out.append(f"layer {i:3d}: mean {s.mean():.3f}  hottest 10% cover {100 * c10:5.1f}%  "
                   f"20% cover {100 * c20:5.1f}%")
    return out
