"""Per-layer activation predictors (PowerInfer's fc1/fc2): which FFN neurons a token will use.

    preds = Predictors.load(path)             # PWRI model with blk.N.fc1/fc2, or a predictor GGUF
    mask = preds.active_mask(layer, h)        # h: residual stream BEFORE ffn_norm, (1, hidden)

A neuron is predicted active where fc2 @ relu(fc1 @ h) > threshold: powerinfer.sparse_threshold
(default 0) for every layer, or per layer from sparseinfer.predictor.thresholds when a trained
predictor file (coordinator/predictor_training.py) carries them. PowerInfer feeds its predictor the FFN input before the norm (llama.cpp's ffn_inp),
so the predictor must see the same tensor it was trained on.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from sparsecore.config import ModelConfig
from sparsecore.errors import ModelFileError
from sparsecore.ffn import FileRows, x_wt
from sparsecore.gguf_file import open_gguf
from sparsecore.kernels import FileMatrix, supports
from sparsecore.predictor_rows import PER_LAYER_KEY, has_predictors, predictor_thresholds  # noqa: F401 (re-exported)
from sparsecore.tensors import TensorStore


class Predictors:
    def __init__(self, fc1: list[torch.Tensor], fc2: list[torch.Tensor], thresholds: list[float], path=None):
        self.fc1, self.fc2, self.thresholds, self.path = fc1, fc2, [float(t) for t in thresholds], path

    @classmethod
    def load(cls, path: str | os.PathLike, cfg: ModelConfig, reader=None, in_file: bool = False,
             fast: bool = False) -> "Predictors":
        """Read blk.N.fc1/fc2 for every layer of `cfg` from `path` (a model or predictor file).
        in_file (--weights gguf): matrices of a type the native kernels read stay in the file's
        blocks (a PowerInfer predictor as float32 is several times the sparse FFN's bytes)."""
        path = Path(path)
        reader = reader if reader is not None else open_gguf(path)
        store = TensorStore(path, reader)
        fc1, fc2 = [], []
        for i in range(cfg.n_layers):
            a, b = f"blk.{i}.fc1.weight", f"blk.{i}.fc2.weight"
            for name in (a, b):
                if not store.has(name):
                    raise ModelFileError(f"{path}: predictor tensor {name} is missing")
            sa, sb = store.shape(a), store.shape(b)
            r = sa[0] if len(sa) == 2 else None
            if r is None or sa != (r, cfg.hidden):
                raise ModelFileError(f"{path}: predictor tensor {a} has shape {sa}, expected (rank, {cfg.hidden})")
            if sb != (cfg.n_ff, r):
                raise ModelFileError(f"{path}: predictor tensor {b} has shape {sb}, expected ({cfg.n_ff}, {r})")
            for name, out in ((a, fc1), (b, fc2)):
                t = store.info(name)
                if in_file and supports(t.tensor_type):
                    out.append(FileRows(FileMatrix(t), None, fast))
                else:
                    out.append(torch.from_numpy(np.ascontiguousarray(store.matrix(name), dtype=np.float32)))
        thr = predictor_thresholds(reader, cfg.n_layers)
        if thr is None:
            raise ModelFileError(f"{path}: {PER_LAYER_KEY} does not have an entry for each of the model's "
                                 f"{cfg.n_layers} layers")
        return cls(fc1, fc2, thr, path)

    @property
    def in_file(self) -> bool:
        """Every fc1/fc2 is read in the file's blocks: the processes that own the neurons can
        score them themselves (sparsecore/predictor_rows.py) with this file's thresholds."""
        return self.path is not None and all(isinstance(m, FileRows) for m in self.fc1 + self.fc2)

    @property
    def n_layers(self) -> int:
        return len(self.fc1)

    def scores(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Predictor outputs (T, n_ff) for pre-norm residual rows h (T, hidden)."""
        return x_wt(torch.relu(x_wt(h.float(), self.fc1[layer])), self.fc2[layer])

    def masks(self, layer: int, h: torch.Tensor | np.ndarray) -> np.ndarray:
        """uint8 (T, n_ff): 1 where a neuron is predicted active for that row's token."""
        if isinstance(h, np.ndarray):
            h = torch.from_numpy(h)
        return (self.scores(layer, h) > self.thresholds[layer]).numpy().astype(np.uint8)

    def active_mask(self, layer: int, x_pre_norm: torch.Tensor) -> np.ndarray:
        """uint8 (n_ff,): 1 where the neuron is predicted active for the single token given."""
        if x_pre_norm.shape[0] != 1:
            raise ValueError(f"active_mask takes one token, got {x_pre_norm.shape[0]}")
        return self.masks(layer, x_pre_norm)[0]
