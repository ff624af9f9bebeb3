"""SwiGLU threshold sparsity (CATS): the math, the calibration, and sparse decoding end to end."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_files import load_thresholds, save_thresholds, thresholds_path
from coordinator.runtime.sampling import SamplingParams
from coordinator.tools import corpus
from coordinator.tools.calibrate import calibrate
from coordinator.tools.perplexity import perplexity
from sparsecore.ffn import ffn_partial_threshold
from tests.fixtures.ffn_reference import ffn_dense_reference
from tests.conftest import REPO
from tests.fixtures.reference_llama import ReferenceLlama


@pytest.mark.parametrize("n_tokens", [1, 5])
@pytest.mark.parametrize("quantile", [0.5, 0.9])  # one token: masked dense above GATHER_BELOW, gathered rows below
def test_threshold_ffn_equals_dense_with_small_activations_zeroed(n_tokens, quantile):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tokens, 32, generator=g)
    gate, up, down_t = (torch.randn(80, 32, generator=g) / 6 for _ in range(3))
    act = torch.nn.functional.silu(x @ gate.T)
    thr = float(act.abs().quantile(quantile))
    y, n_active = ffn_partial_threshold(x, gate, up, down_t, "silu", thr)
    mask = act.abs() > thr
    want = ffn_dense_reference(x, gate, up, down_t.T, "silu", mask)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert n_active == int(mask.sum())
    assert 0 < n_active < mask.numel()
    dense = ffn_dense_reference(x, gate, up, down_t.T, "silu")
    assert not torch.allclose(y, dense, atol=1e-3)  # it really dropped something


def test_threshold_above_every_activation_gives_zero():
    x, w = torch.randn(1, 8), torch.randn(16, 8)
    y, n = ffn_partial_threshold(x, w, w, w, "silu", 1e9)
    assert n == 0 and torch.count_nonzero(y) == 0


def test_corpus_split_is_deterministic_and_disjoint():
    text = corpus.default_text()
    calib, held = corpus.split(text)
    assert len(calib) > 100_000 and len(held) > 100_000
    assert corpus.split(text) == (calib, held)
    assert held[:200] not in calib
    assert corpus.token_chunks(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.fixture(scope="module")
def calibrated(tiny_model_factory):
    path = tiny_model_factory(tensor_type="F32", seed=3)
    with Engine(path, EngineOptions(cpu_workers=1, threads=2)) as eng:
        ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:20000])
        table = calibrate(eng, corpus.token_chunks(ids, 64, 6), levels=(0.3, 0.5))
    save_thresholds(path, table)
    return path, table


def test_calibration_hits_target_sparsity_on_its_own_text(calibrated):
    path, table = calibrated
    assert json.loads(thresholds_path(path).read_text())["levels"].keys() == {"0.30", "0.50"}
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, sparsity=0.5, sparse_method="cats")) as eng:
        ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:20000])
        r = perplexity(eng, corpus.token_chunks(ids, 64, 6))
    assert r["active_fraction"] == pytest.approx(0.5, abs=0.02)
    t30, t50 = table["levels"]["0.30"], table["levels"]["0.50"]
    assert all(a < b for a, b in zip(t30, t50))  # more sparsity, higher thresholds


@pytest.mark.parametrize("coordinator_share", [0.0, 0.4])
def test_sparse_decoding_matches_oracle_with_same_thresholds(calibrated, coordinator_share):
    """Real workers (and the coordinator, for its share) skipping neurons per token give the
    oracle's tokens, and differ from dense."""
    path, _ = calibrated
    thr = load_thresholds(path, 0.5)
    ref = ReferenceLlama(path)
    with Engine(path, EngineOptions(cpu_workers=2, threads=2, gpu_share=0.3, sparsity=0.5, sparse_method="cats",
                                    coordinator_share=coordinator_share, fast=False)) as eng:
        assert (eng.pool.own_slot is not None) == (coordinator_share > 0)
        ids = eng.tokenizer.encode("the quick brown fox")
        got = list(eng.generate(ids, 10, SamplingParams(0.0), stop_at_eos=False))
        st = eng.ffn.stats
        decode_active = [st.active[l] / st.tokens[l] for l in st.active]
    assert got == ref.greedy(ids, 10, thr)
    assert max(decode_active) < eng.cfg.n_ff  # fewer neurons than dense were computed


def test_missing_thresholds_is_one_clear_error(tiny_model):
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(tiny_model), "-p", "hi",
                        "-n", "2", "--sparsity", "0.4"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("error:") and "sparseinfer calibrate" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
