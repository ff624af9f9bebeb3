"""Predictor training (`sparseinfer train-predictor`) on a tiny synthetic model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_files import load_predictor, load_thresholds, save_predictor, save_thresholds
from coordinator.tools import corpus, observe
from coordinator.tools import train_predictor as pt
from coordinator.tools.calibrate import calibrate


@pytest.fixture(scope="module")
def observed(tiny_model_factory):
    """Calibrated tiny model, and its observations on calibration and held-out text."""
    path = tiny_model_factory(tensor_type="F32", seed=5)
    with Engine(path, EngineOptions(cpu_workers=1, threads=2)) as eng:
        ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:60000])
        chunks = corpus.token_chunks(ids, 128, 24)
        save_thresholds(path, calibrate(eng, chunks, levels=(0.5,)))
        seen = []
        observe.dense_run(eng, [chunks[0][:5]], lambda layer, x, pre: seen.append((layer, x.shape, pre.shape)))
        assert seen and all(s == p for _, s, p in seen)  # the observer gets normed and pre-norm rows
        train = pt.collect(eng, chunks, load_thresholds(path, 0.5))
        hid = eng.tokenizer.encode(corpus.load(None, "heldout")[:30000])
        held = pt.collect(eng, corpus.token_chunks(hid, 128, 8), load_thresholds(path, 0.5))
        cfg = eng.cfg
    return path, cfg, train, held


def test_targets_follow_the_cats_rule(observed):
    _, cfg, train, _ = observed
    assert len(train) == cfg.n_layers
    for d in train:
        assert d.x.shape[1] == cfg.hidden and d.targets().shape == (len(d.x), cfg.n_ff)
        assert d.targets().float().mean() == pytest.approx(0.5, abs=0.03)  # calibrated at 0.5 on this text


def test_training_beats_random_init_and_meets_recall_on_heldout(observed):
    _, _, train, held = observed
    kw = dict(rank=64, recall=0.9, seed=0, dtype="F32", lr=1e-2)
    trained = pt.train_predictors(train, held, epochs=20, **kw)
    untrained = pt.train_predictors(train, held, epochs=0, **kw)
    for a, b in zip(trained.heldout, untrained.heldout):
        # the threshold is chosen on a validation slice of the calibration text, not on held-out text
        assert a["recall"] == pytest.approx(0.9, abs=0.04)
        assert a["precision"] > b["precision"] + 0.05
        assert a["predicted_active"] < b["predicted_active"] - 0.05
    # at a fixed threshold of 0 too, training separates active from inactive better
    with torch.no_grad():
        for i, d in enumerate(held):
            y = d.targets()
            acc = [float(((pt.logits(p.fc1[i], p.fc2[i], d.x) > 0) == y).float().mean()) for p in (trained, untrained)]
            assert acc[0] > acc[1]


def test_saved_gguf_round_trips(observed, tmp_path):
    path, cfg, train, held = observed
    p = pt.train_predictors(train, held, rank=8, recall=0.9, epochs=1, dtype="F16", target_sparsity=0.5)
    out = save_predictor(tmp_path / "p.predictor.gguf", p, model=path)
    assert out.read_bytes()[:4] == b"GGUF"
    r = GGUFReader(out)
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in r.tensors}
    want = {}
    for i in range(cfg.n_layers):
        want[f"blk.{i}.fc1.weight"] = (8, cfg.hidden)
        want[f"blk.{i}.fc2.weight"] = (cfg.n_ff, 8)
    assert shapes == want
    assert {t.tensor_type.name for t in r.tensors} == {"F16"}
    fc1, fc2, thr, meta = load_predictor(out)
    assert meta["sparseinfer.predictor.rank"] == 8
    assert meta["sparseinfer.predictor.target_sparsity"] == pytest.approx(0.5)
    assert meta["powerinfer.sparse_threshold"] == pytest.approx(p.sparse_threshold)
    assert thr == pytest.approx(p.thresholds)
    if not meta["sparseinfer.predictor.per_layer"]:
        assert all(t == meta["powerinfer.sparse_threshold"] for t in thr)
    for i in range(cfg.n_layers):
        np.testing.assert_array_equal(fc1[i], p.fc1[i])
        np.testing.assert_array_equal(fc2[i], p.fc2[i])
        # the stored weights and threshold give the reported held-out numbers
        m = pt.metrics(pt.logits(fc1[i], fc2[i], held[i].x), held[i].targets(), thr[i])
        assert m == pytest.approx(p.heldout[i])


def test_threshold_folding_keeps_decisions():
    g = torch.Generator().manual_seed(0)
    fc2 = [torch.randn(6, 3, generator=g).numpy() for _ in range(3)]
    h = torch.rand(10, 3, generator=g).numpy()
    for raw in ([0.3, 1.2, 0.01], [-0.5, -2.0, -0.1]):
        new, thr, shared, per_layer = pt.fold_thresholds(fc2, raw)
        assert not per_layer and thr == [shared] * 3 and abs(shared) == 1.0
        for w, w2, t in zip(fc2, new, raw):
            assert np.array_equal(h @ w.T > t, h @ w2.T > shared)
    new, thr, _, per_layer = pt.fold_thresholds(fc2, [0.5, -0.5, 0.1])
    assert per_layer and thr == [0.5, -0.5, 0.1]


def test_threshold_for_recall():
    s = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    y = torch.ones(10, 10, dtype=torch.bool)
    t = pt.threshold_for_recall(s, y, 0.9)
    assert pt.metrics(s, y, t)["recall"] == pytest.approx(0.9)
    assert pt.metrics(s, y, pt.threshold_for_recall(s, y, 1.0))["recall"] == 1.0
