"""PowerInfer's own architectures in its PWRI layout (bamboo, ReluFalcon) against transformers,
through the real coordinator and worker processes, and the offline tools (calibrate,
train-predictor, profile + placement) on architectures other than llama.

The tiny files (tests/fixtures/tiny_arch.py, POWERINFER) are written as PowerInfer's converters
write them; scripts/make_arch_reference.py committed transformers' greedy ids and logits for the
same weights, dense and "predicted" (the prompt dense, every later position with the neurons the
file's own fc1/fc2 pick). Dense runs use --predictor none. Ids must match exactly, logits within
LOGITS_ATOL (as tests/test_architectures.py); exact arithmetic throughout (fast=False).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_files import gpuidx_path, load_thresholds, profile_path, save_profile, save_thresholds
from coordinator.runtime.sampling import SamplingParams
from coordinator.tools import corpus
from coordinator.tools import train_predictor as pt
from coordinator.tools.calibrate import calibrate
from coordinator.tools.perplexity import perplexity
from coordinator.tools.profile import collect
from sparsecore.config import read_config
from sparsecore.gguf_file import open_gguf
from tests.fixtures.tiny_arch import POWERINFER, write_tiny_arch

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "arch_reference.json").read_text())
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("piarch")
    return {a: write_tiny_arch(d / f"tiny-{a}.powerinfer.gguf", a) for a in POWERINFER + ("falcon40b", "falcon")}


def _ref_logits(key: str) -> np.ndarray:
    return np.load(FIXTURES / "arch_reference_logits.npz")[key]


def test_files_read_as_powerinfer_writes_them(models):
    b = models["bamboo"]
    assert b.read_bytes()[:4] == b"PWRI"
    r = open_gguf(b)
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_down_t.weight" in names and "blk.0.fc1.weight" in names and "blk.0.ffn_down.weight" not in names
    c = read_config(b, r)
    assert (c.arch, c.activation, c.ffn_gate, c.permuted_qk, c.sparse_threshold) == ("bamboo", "relu", "sym", True, 0.0)
    f = read_config(models["relufalcon"], open_gguf(models["relufalcon"]))
    assert (f.arch, f.activation, f.ffn_gate, f.layer_norm, f.parallel, f.permuted_qk) == (
        "falcon", "relu", "none", True, True, False)
    assert f.n_ff == 256 and f.n_kv_heads == 2 and f.native_attention
    g = read_config(models["falcon"], open_gguf(models["falcon"]))
    assert g.activation == "gelu" and g.n_kv_heads == 1 and g.sparse_threshold is None


@pytest.mark.parametrize("weights", ["gguf", "f32"])
@pytest.mark.parametrize("arch", POWERINFER)
def test_dense_matches_transformers(models, arch, weights, no_leaks):
    cases = REF["archs"][arch]
    with Engine(models[arch], EngineOptions(cpu_workers=1, threads=2, weights=weights, predictor="none",
                                            fast=False)) as eng:
        assert eng.predictors is None
        for case in cases:
            got = list(eng.generate(case["prompt_ids"], len(case["generated_ids"]), SamplingParams(temperature=0.0),
                                    stop_at_eos=False))
            assert got == case["generated_ids"]
        seq = cases[0]["prompt_ids"] + cases[0]["generated_ids"]
        logits = eng.forward_logits(seq)
    assert float(np.abs(logits - _ref_logits(arch)).max()) < LOGITS_ATOL


@pytest.mark.parametrize("weights", ["gguf", "f32"])
@pytest.mark.parametrize("arch", POWERINFER)
def test_the_files_predictors_decode_as_transformers_with_their_masks(models, arch, weights, no_leaks):
    """Decoding with the file's own predictors (on by default for a PWRI file): the same tokens
    as transformers with the same masks, each step's logits within LOGITS_ATOL, and a sizeable
    share of the neurons really skipped (bamboo: the gate's; falcon: up's, having no gate)."""
    cases = REF["archs"][arch + ".predicted"]
    with Engine(models[arch], EngineOptions(cpu_workers=2, threads=2, weights=weights, fast=False)) as eng:
        assert eng.predictors is not None
        n_ff = eng.cfg.n_ff
        for case in cases:
            st = eng.ffn.stats
            st.active.clear()
            st.tokens.clear()
            got = list(eng.generate(case["prompt_ids"], len(case["generated_ids"]), SamplingParams(0.0),
                                    stop_at_eos=False))
            assert got == case["generated_ids"]
        assert got != REF["archs"][arch][1]["generated_ids"]  # the masks matter
        decoded = len(got) - 1
        for layer, a in st.active.items():
            sparse = a - len(cases[1]["prompt_ids"]) * n_ff  # prefill is dense
            assert 0 < sparse < 0.8 * decoded * n_ff
        case = cases[0]
        eng.reset()
        steps = [eng.model.forward(list(case["prompt_ids"]))[-1]]
        for t in case["generated_ids"]:
            steps.append(eng.model.forward([t])[-1])
    np.testing.assert_allclose(np.stack(steps), _ref_logits(arch + ".predicted"), atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("path", ["lockstep", "split"])
def test_relufalcon_predicts_from_the_layer_input_on_the_native_path(models, path, no_leaks):
    """ReluFalcon's attention native and split across the processes, its predictors reading the
    layer's input (a parallel block): in lockstep each process scores its neurons before the
    attention phase changes its residual. The tokens and every step's logits are transformers'
    with the file's masks."""
    cases = REF["archs"]["relufalcon.predicted"]
    lockstep = path == "lockstep"
    opts = EngineOptions(cpu_workers=1, threads=2, fast=False, decode_path=path, kv_caches=2,
                         adaptive_spin=False if lockstep else None)
    with Engine(models["relufalcon"], opts) as eng:
        assert eng.predictors is not None
        assert eng.model.decode_plan.path.value == ("lockstep" if lockstep else "split attention")
        for case in cases:
            got = list(eng.generate(case["prompt_ids"], len(case["generated_ids"]), SamplingParams(0.0),
                                    stop_at_eos=False))
            assert got == case["generated_ids"]
        case = cases[0]
        eng.reset()
        steps = [eng.model.forward(list(case["prompt_ids"]))[-1]]
        for t in case["generated_ids"]:
            steps.append(eng.model.forward([t])[-1])
        decoded = sum(len(c["generated_ids"]) - 1 for c in cases) + len(case["generated_ids"])
        assert len(eng.ffn.stats.lockstep_us) == (decoded if lockstep else 0)
    np.testing.assert_allclose(np.stack(steps), _ref_logits("relufalcon.predicted"), atol=LOGITS_ATOL, rtol=0)


def test_falcon_gateless_sparsity_calibrates_and_runs(models, no_leaks):
    """Thresholds on a gate-less FFN read |gelu(up x)|: the calibrated level is hit, and the
    native kernels (ACT_NOGATE) and the torch path decode the same sparse tokens."""
    path = models["falcon40b"]
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:8000])
        save_thresholds(path, calibrate(eng, corpus.token_chunks(ids, 64, 4), levels=(0.5,)))
    assert all(t > 0 for t in load_thresholds(path, 0.5))
    prompt = REF["archs"]["falcon40b"][0]["prompt_ids"]
    tokens = {}
    for weights in ("gguf", "f32"):
        with Engine(path, EngineOptions(cpu_workers=1, threads=2, sparsity=0.5, sparse_method="cats", weights=weights,
                                        fast=False)) as eng:
            text = eng.tokenizer.encode(corpus.load(None, "calibration")[:8000])
            assert perplexity(eng, corpus.token_chunks(text, 64, 4))["active_fraction"] == pytest.approx(0.5, abs=0.03)
            tokens[weights] = list(eng.generate(prompt, 12, SamplingParams(0.0), stop_at_eos=False))
    assert tokens["gguf"] == tokens["f32"]


def test_train_predictor_on_falcon(models, no_leaks):
    """train-predictor's pieces on a ReLU falcon: targets relu(up x) > 0 from the layer's input
    (what PowerInfer's falcon predictor reads), and trained predictors reach the asked recall."""
    path = models["relufalcon"]
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, predictor="none", fast=False)) as eng:
        ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:30000])
        train = pt.collect(eng, corpus.token_chunks(ids, 96, 12), None)
        hid = eng.tokenizer.encode(corpus.load(None, "heldout")[:12000])
        held = pt.collect(eng, corpus.token_chunks(hid, 96, 4), None)
        cfg = eng.cfg
    assert len(train) == cfg.n_layers and train[0].x.shape[1] == cfg.hidden
    frac = float(train[0].targets().float().mean())
    assert 0.2 < frac < 0.8
    kw = dict(rank=32, recall=0.9, seed=0, dtype="F32", lr=1e-2)
    trained = pt.train_predictors(train, held, epochs=10, **kw)
    untrained = pt.train_predictors(train, held, epochs=0, **kw)
    for a, b in zip(trained.heldout, untrained.heldout):
        # the recall is set on a validation slice of calibration text: held-out text lands near it
        assert a["recall"] > 0.75 and a["predicted_active"] < 0.95
        assert a["precision"] > b["precision"]


def test_profile_and_budget_placement_on_bamboo(models, tmp_path, no_leaks):
    """profile (ReLU: relu(gate x) > 0) and a VRAM-budget plan on bamboo; the placed model
    decodes the dense tokens of transformers."""
    path = models["bamboo"]
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, predictor="none", fast=False)) as eng:
        ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:12000])
        prof = collect(eng, corpus.token_chunks(ids, 48, 4))
    assert prof.n_layers == 2 and all(f.shape == (128,) for f in prof.freqs)
    assert all(0 < f.mean() < 1 for f in prof.freqs) and max(f.max() for f in prof.freqs) > min(f.min() for f in prof.freqs)
    save_profile(prof, profile_path(path))
    gpuidx_path(path).unlink(missing_ok=True)
    case = REF["archs"]["bamboo"][0]
    budget_gb = 60 * 3 * 64 * 4 / (1 << 30)  # 60 float32 neurons (gate, up, down rows)
    try:
        with Engine(path, EngineOptions(cpu_workers=2, threads=2, vram_budget_gb=budget_gb, weights="f32",
                                        predictor="none", fast=False)) as eng:
            got = list(eng.generate(case["prompt_ids"], 16, SamplingParams(0.0), stop_at_eos=False))
            gpu = eng.plan.shards[0].neurons
        assert sum(len(g) for g in gpu) == 60 and gpuidx_path(path).exists()
        flat = np.concatenate(prof.freqs)
        chosen = np.concatenate([prof.freqs[l][g] for l, g in enumerate(gpu)])
        assert chosen.min() >= np.sort(flat)[::-1][59] - 1e-7
        assert got == case["generated_ids"]
    finally:
        gpuidx_path(path).unlink(missing_ok=True)
        profile_path(path).unlink(missing_ok=True)
