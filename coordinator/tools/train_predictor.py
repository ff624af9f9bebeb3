"""Training PowerInfer-style activation predictors (PowerInfer never released its training code).

One small network per layer guesses, from the FFN input *before* ffn_norm (the residual stream
after attention, as in PowerInfer), which FFN neurons will be active for a token:

    logits = fc2 @ relu(fc1 @ x)        fc1: (rank, hidden), fc2: (n_ff, rank), no biases
    neuron n is predicted active where logits[n] > powerinfer.sparse_threshold

Targets come from the dense model run over calibration text, by the rule of
coordinator.tools.observe:
  - SwiGLU models: active where |act(gate x_normed)| > the layer's calibrated CATS threshold at
    the target sparsity (coordinator/tools/calibrate.py), i.e. the neurons threshold sparsity keeps;
  - ReLU models: active where relu(gate x_normed) > 0.
Training: Adam, BCE-with-logits with pos_weight > 1 (a missed active neuron costs more than a
wasted one), a fixed seed. Inputs are scaled per dimension while training and the scale is
folded into fc1, so the stored weights take the raw residual stream.

Decision threshold: per layer, the largest logit threshold whose recall reaches the target on a
validation slice of the calibration text (the last eighth of its chunks, not trained on). The
network has no biases, so a positive factor on fc2 rescales a layer's logits; when every layer's
threshold has the same sign, each fc2 is rescaled so that all layers share one threshold (+1 or
-1), stored as `powerinfer.sparse_threshold`, and a PowerInfer-style reader needs nothing else.
`sparseinfer.predictor.thresholds` always holds the per-layer thresholds for the stored weights
(all equal to `powerinfer.sparse_threshold` when folded); `sparseinfer.predictor.per_layer` says
whether they differ. Recall, precision and the predicted-active fraction are then measured on the
held-out half of the corpus with the weights exactly as stored. The file is written by
coordinator.runtime.model_files.save_predictor (`<model>.predictor.gguf`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import observe

DEFAULT_RANK = 64
DEFAULT_RECALL = 0.95


@dataclass
class LayerData:
    """One layer's observations: pre-norm inputs (N, hidden) and packed active bits (N, n_ff/8)."""
    x: np.ndarray
    bits: np.ndarray
    n_ff: int

    def targets(self, rows=slice(None)) -> torch.Tensor:
        return torch.from_numpy(np.unpackbits(self.bits[rows], axis=1, count=self.n_ff).astype(bool))


def collect(engine, chunks, thresholds: list[float] | None, progress=None) -> list[LayerData]:
    """Run the dense model over `chunks`, recording per layer the pre-norm FFN input and which
    neurons are active. `thresholds`: per-layer CATS thresholds (SwiGLU) or None (ReLU: > 0)."""
    cfg = observe.config(engine)
    gates = observe.GateActivity(engine, keep=True)
    xs: list[list[np.ndarray]] = [[] for _ in range(cfg.n_layers)]
    ys: list[list[np.ndarray]] = [[] for _ in range(cfg.n_layers)]

    def observe_layer(layer, x_normed, pre_norm):
        on = observe.active(gates(layer, x_normed), 0.0 if thresholds is None else thresholds[layer])
        xs[layer].append(np.array(pre_norm, dtype=np.float32, copy=True))
        ys[layer].append(np.packbits(on.numpy(), axis=1))

    observe.dense_run(engine, chunks, observe_layer, progress)
    return [LayerData(np.concatenate(xs[i]), np.concatenate(ys[i]), cfg.n_ff) for i in range(cfg.n_layers)]


class Predictor(torch.nn.Module):
    def __init__(self, hidden: int, n_ff: int, rank: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, rank, bias=False)
        self.fc2 = torch.nn.Linear(rank, n_ff, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def logits(fc1: np.ndarray, fc2: np.ndarray, x: np.ndarray | torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(x, dtype=torch.float32)
    return torch.relu(x @ torch.as_tensor(fc1, dtype=torch.float32).T) @ torch.as_tensor(fc2, dtype=torch.float32).T


def train_layer(data: LayerData, rows: np.ndarray, rank: int, epochs: int, seed: int = 0, lr: float = 3e-3,
                batch: int = 256, pos_weight: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """(fc1, fc2) as float32 numpy, fc1 taking raw pre-norm inputs. epochs=0: the random init."""
    x = torch.from_numpy(data.x[rows])
    y = data.targets(rows).float()
    scale = x.pow(2).mean(0).sqrt().clamp_min(1e-6)
    xs = x / scale
    torch.manual_seed(seed)
    net = Predictor(x.shape[1], data.n_ff, rank)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    steps = epochs * math.ceil(len(xs) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, steps))))
    lossf = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(xs), generator=gen)
        for a in range(0, len(xs), batch):
            idx = perm[a:a + batch]
            loss = lossf(net(xs[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        fc1 = (net.fc1.weight / scale[None, :]).numpy().astype(np.float32)
        fc2 = net.fc2.weight.numpy().astype(np.float32).copy()
    return fc1, fc2


def threshold_for_recall(scores: torch.Tensor, targets: torch.Tensor, recall: float) -> float:
    """The largest t with recall of (scores > t) at least `recall` (ties aside)."""
    pos = scores[targets].flatten()
    if pos.numel() == 0:
        return float(scores.max())
    k = int(math.floor((1.0 - recall) * pos.numel() + 1e-6))  # positives allowed below the threshold
    if k <= 0:
        return float(pos.min()) - 1e-6 * max(1.0, abs(float(pos.min())))
    return float(torch.kthvalue(pos, k).values)


def metrics(scores: torch.Tensor, targets: torch.Tensor, threshold: float) -> dict:
    pred = scores > threshold
    tp = int((pred & targets).sum())
    n_pos, n_pred = int(targets.sum()), int(pred.sum())
    return {"recall": tp / n_pos if n_pos else 1.0, "precision": tp / n_pred if n_pred else 1.0,
            "predicted_active": n_pred / pred.numel(), "true_active": n_pos / targets.numel()}


@dataclass
class TrainedPredictors:
    fc1: list[np.ndarray]
    fc2: list[np.ndarray]
    thresholds: list[float]  # per layer, for the weights as stored
    sparse_threshold: float  # powerinfer.sparse_threshold
    per_layer: bool  # True when the layers' thresholds could not be folded into one
    rank: int
    target_sparsity: float | None  # None for ReLU targets (relu > 0)
    target_recall: float
    dtype: str
    heldout: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def mean(self, which: str = "heldout") -> dict:
        rows = getattr(self, which)
        return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


def _as_stored(w: np.ndarray, dtype: str) -> np.ndarray:
    return w.astype(np.float16).astype(np.float32) if dtype == "F16" else w


def fold_thresholds(fc2: list[np.ndarray], thresholds: list[float]) -> tuple[list[np.ndarray], list[float], float, bool]:
    """Rescale each layer's fc2 by a positive factor so all layers share one threshold (+-1),
    possible when every threshold is nonzero and of one sign. Returns (fc2, per-layer, shared, per_layer)."""
    t = np.asarray(thresholds, dtype=np.float64)
    if np.all(t > 0) or np.all(t < 0):
        shared = 1.0 if t[0] > 0 else -1.0
        return [w * np.float32(1.0 / abs(ti)) for w, ti in zip(fc2, t)], [shared] * len(t), shared, False
    return list(fc2), [float(v) for v in t], 0.0, True


def train_predictors(layers: list[LayerData], heldout: list[LayerData] | None, *, rank: int = DEFAULT_RANK,
                     recall: float = DEFAULT_RECALL, epochs: int = 4, seed: int = 0, dtype: str = "F16",
                     target_sparsity: float | None = None, val_fraction: float = 0.125,
                     progress=None, **train_kw) -> TrainedPredictors:
    """Train one predictor per layer on `layers` (minus a validation tail that picks the threshold),
    then measure it on `heldout` (if given) with the weights as they will be stored."""
    if not 0.0 < recall <= 1.0:
        raise ValueError(f"recall must be in (0, 1], got {recall}")
    if dtype not in ("F16", "F32"):
        raise ValueError(f"dtype must be F16 or F32, got {dtype}")
    n = len(layers[0].x)
    n_val = max(1, int(round(n * val_fraction)))
    if n - n_val < 1:
        raise ValueError(f"{n} calibration tokens are too few to train and validate on")
    train_rows, val_rows = np.arange(n - n_val), np.arange(n - n_val, n)
    fc1s, fc2s, thr, val = [], [], [], []
    t0 = time.perf_counter()
    for i, d in enumerate(layers):
        fc1, fc2 = train_layer(d, train_rows, rank, epochs, seed=seed + i, **train_kw)
        fc1 = _as_stored(fc1, dtype)
        with torch.no_grad():
            s = logits(fc1, fc2, d.x[val_rows])
        y = d.targets(val_rows)
        t = threshold_for_recall(s, y, recall)
        fc1s.append(fc1), fc2s.append(fc2), thr.append(t), val.append(metrics(s, y, t))
        if progress:
            progress(1)
    fc2s, thr_stored, shared, per_layer = fold_thresholds(fc2s, thr)
    fc2s = [_as_stored(w, dtype) for w in fc2s]
    out = TrainedPredictors(fc1s, fc2s, thr_stored, shared, per_layer, rank, target_sparsity, recall, dtype,
                            validation=val)
    out.info = {"train_tokens": int(n - n_val), "val_tokens": int(n_val), "epochs": epochs,
                "train_seconds": round(time.perf_counter() - t0, 1), "raw_thresholds": thr}
    if heldout is not None:
        out.heldout = evaluate(out, heldout)
        out.info["heldout_tokens"] = int(len(heldout[0].x))
    return out


def evaluate(p: TrainedPredictors, layers: list[LayerData]) -> list[dict]:
    rows = []
    with torch.no_grad():
        for i, d in enumerate(layers):
            rows.append(metrics(logits(p.fc1[i], p.fc2[i], d.x), d.targets(), p.thresholds[i]))
    return rows
