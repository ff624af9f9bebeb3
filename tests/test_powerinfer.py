"""PowerInfer GGUF (magic PWRI) with its own predictors: file layout, reading, and sparse decoding
end to end with real worker processes, checked against the independent float64 oracle."""
from __future__ import annotations

import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.model.predictor import Predictors
from coordinator.runtime.sampling import SamplingParams
from coordinator.tools import observe
from coordinator.tools.perplexity import perplexity
from sparsecore.config import read_config
from sparsecore.errors import ModelFileError
from sparsecore.gguf_file import open_gguf
from tests.conftest import REPO
from tests.fixtures.tiny_powerinfer import tiny_powerinfer_tensors, write_tiny_powerinfer
from tests.fixtures.reference_llama import ReferenceLlama

N_FF, HIDDEN, RANK = 160, 64, 16
PROMPT = "the quick brown fox"
OPTS = dict(cpu_workers=2, threads=2, gpu_share=0.3, fast=False)  # exact: the oracle's arithmetic


@pytest.fixture(scope="module")
def pwri(tmp_path_factory):
    return write_tiny_powerinfer(tmp_path_factory.mktemp("pwri") / "tiny.powerinfer.gguf")


def _write_predictor_file(path, fc: dict[str, np.ndarray], threshold: float):
    """A separate predictor GGUF: blk.N.fc1/fc2 and powerinfer.sparse_threshold."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_float32("powerinfer.sparse_threshold", threshold)
    for name, arr in fc.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _fc_tensors() -> dict[str, np.ndarray]:
    return {k: v for k, v in tiny_powerinfer_tensors().items() if ".fc" in k}


# ---- the file ---------------------------------------------------------------------------------

def test_fixture_has_powerinfer_layout(pwri):
    """Names and GGML dims as PowerInfer's llama.cpp creates them for LLM_ARCH_LLAMA."""
    assert pwri.read_bytes()[:4] == b"PWRI"
    with pytest.raises(ValueError):
        gguf.GGUFReader(pwri)  # why sparsecore needs its own reader for these files
    r = open_gguf(pwri)
    ne = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert ne["blk.0.ffn_down_t.weight"] == [HIDDEN, N_FF]   # {n_embd, n_ff}
    assert ne["blk.1.fc1.weight"] == [HIDDEN, RANK]          # {n_embd, rank}
    assert ne["blk.1.fc2.weight"] == [RANK, N_FF]            # {rank, n_ff}
    assert ne["blk.0.ffn_gate.weight"] == ne["blk.0.ffn_up.weight"] == [HIDDEN, N_FF]
    assert not any(n.endswith("ffn_down.weight") for n in ne)
    f = r.fields["powerinfer.sparse_threshold"]
    assert f.types == [gguf.GGUFValueType.FLOAT32] and f.contents() == 0.0
    cfg = read_config(pwri, r)
    assert cfg.activation == "relu" and cfg.sparse_threshold == 0.0


def test_pwri_reads_like_its_gguf_copy(pwri, tmp_path):
    copy = tmp_path / "as_gguf.gguf"
    shutil.copyfile(pwri, copy)
    with open(copy, "r+b") as f:
        f.write(b"GGUF")
    a, b = open_gguf(pwri), open_gguf(copy)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type and list(ta.shape) == list(tb.shape)
        np.testing.assert_array_equal(np.asarray(ta.data), np.asarray(tb.data))
    keys = set(a.fields) - {"GGUF.magic"}
    assert keys == set(b.fields) - {"GGUF.magic"}
    for k in keys:
        if not k.startswith("GGUF."):
            assert a.fields[k].contents() == b.fields[k].contents(), k


def test_predictor_mask_is_fc2_relu_fc1_above_threshold(pwri):
    cfg = read_config(pwri, open_gguf(pwri))
    p = Predictors.load(pwri, cfg)
    fc = _fc_tensors()
    h = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1))
    for layer in range(cfg.n_layers):
        want = np.maximum(h.double().numpy() @ fc[f"blk.{layer}.fc1.weight"].T, 0) @ fc[f"blk.{layer}.fc2.weight"].T
        mask = p.active_mask(layer, h)
        assert mask.dtype == np.uint8 and mask.shape == (N_FF,)
        np.testing.assert_array_equal(mask, (want[0] > 0).astype(np.uint8))
        assert 0 < mask.sum() < N_FF


# ---- decoding with the model's own predictors ----------------------------------------------

@pytest.fixture(scope="module")
def oracle(pwri):
    return ReferenceLlama(pwri)


def _decode_logits(eng, ids, n):
    """Greedy decoding through the engine's token loop pieces, keeping every step's logits."""
    eng.reset()
    logits = [eng.model.forward(list(ids))[-1]]
    toks = []
    for _ in range(n - 1):
        toks.append(int(np.argmax(logits[-1])))
        logits.append(eng.model.forward([toks[-1]])[-1])
    return np.stack(logits), toks


@pytest.mark.parametrize("weights", ["f32", "gguf"])
def test_decode_uses_the_files_predictors(pwri, oracle, weights, no_leaks):
    """Also with the file's own blocks (gguf): the native kernel reads ffn_down_t's rows of the
    predicted neurons only."""
    n = 10
    with Engine(pwri, EngineOptions(**OPTS, weights=weights)) as eng:
        assert eng.predictors is not None and eng.cfg.activation == "relu"
        # in the file's blocks every process scores its own neurons (FLAG_PREDICT steps)
        assert (eng.ffn.shard_predictors is eng.predictors) == (weights == "gguf")
        ids = eng.tokenizer.encode(PROMPT)
        got = list(eng.generate(ids, n, SamplingParams(0.0), stop_at_eos=False))
        active = dict(eng.ffn.stats.active)
        st = eng.ffn.stats
        st.active.clear()
        logits, toks = _decode_logits(eng, ids, n)
        if weights == "gguf":  # the coordinator scoring every neuron and sending masks: the same floats
            eng.ffn.shard_predictors = None
            st.active.clear()
            logits_masks, _ = _decode_logits(eng, ids, n)
            np.testing.assert_array_equal(logits_masks, logits)
    want = oracle.greedy(ids, n, predictor=True)
    assert got == want
    assert got != oracle.greedy(ids, n)  # the dense model goes elsewhere: the masks matter
    # Prefill dense, then exactly the predicted neurons of each decode step, per layer.
    oracle.greedy(ids, n, predictor=True)  # its last pass covers every position the engine decoded
    for layer, k in enumerate(oracle.last_keep):
        assert active[layer] == len(ids) * N_FF + int(k[len(ids):].sum())
        assert int(k[len(ids):].sum()) < (n - 1) * N_FF * 0.7
    ref = oracle.positionwise_logits(ids + toks, len(ids), None, predictor=True)[len(ids) - 1:]
    np.testing.assert_allclose(logits, ref, atol=2e-4, rtol=0)


def test_perplexity_applies_a_predicted_mask_per_token(pwri, oracle, no_leaks):
    with Engine(pwri, EngineOptions(**OPTS)) as eng:
        ids = eng.tokenizer.encode("Hello, world! How are you today? The weather is nice.")
        with observe.sparse_batches(eng):
            got = observe.all_logits(eng, ids)
        r = perplexity(eng, [ids])
    want = oracle.logits(ids, predictor=True)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    # float32 vs float64 may flip a score sitting on the threshold: allow one neuron
    one = 1 / (len(ids) * N_FF * len(oracle.last_keep))
    assert r["active_fraction"] == pytest.approx(np.mean([k.mean() for k in oracle.last_keep]), abs=1.5 * one)


def test_huge_threshold_predicts_nothing_and_none_is_dense(pwri, oracle, tmp_path, no_leaks):
    """Negative control: the same model with a threshold no score reaches computes no decode
    neuron (the FFN of generated tokens is zero); --predictor none gives the dense model."""
    off = write_tiny_powerinfer(tmp_path / "off.powerinfer.gguf", sparse_threshold=1e9)
    n = 6
    with Engine(off, EngineOptions(**OPTS)) as eng:
        ids = eng.tokenizer.encode(PROMPT)
        got_off = list(eng.generate(ids, n, SamplingParams(0.0), stop_at_eos=False))
        assert all(v == len(ids) * N_FF for v in eng.ffn.stats.active.values())
    assert got_off == ReferenceLlama(off).greedy(ids, n, predictor=True)
    assert got_off != oracle.greedy(ids, n, predictor=True)
    with Engine(pwri, EngineOptions(**OPTS, predictor="none")) as eng:
        assert eng.predictors is None
        got_dense = list(eng.generate(ids, n, SamplingParams(0.0), stop_at_eos=False))
    assert got_dense == oracle.greedy(ids, n)


def test_separate_predictor_file_replaces_the_models_own(pwri, tmp_path, no_leaks):
    fc = _fc_tensors()
    pred = _write_predictor_file(tmp_path / "tiny.powerinfer.gguf.predictor.gguf", fc, 1e9)
    with Engine(pwri, EngineOptions(**OPTS, predictor=str(pred))) as eng:
        assert eng.predictors.thresholds == [1e9, 1e9]
        ids = eng.tokenizer.encode(PROMPT)
        list(eng.generate(ids, 4, SamplingParams(0.0), stop_at_eos=False))
        assert all(v == len(ids) * N_FF for v in eng.ffn.stats.active.values())


# ---- errors -------------------------------------------------------------------------------------

def test_missing_predictor_tensor_is_named(tmp_path, no_leaks):
    bad = write_tiny_powerinfer(tmp_path / "bad.powerinfer.gguf", omit=("blk.1.fc2.weight",))
    with pytest.raises(ModelFileError, match=r"bad\.powerinfer\.gguf: predictor tensor blk\.1\.fc2\.weight is missing"):
        Engine(bad, EngineOptions(**OPTS))


def test_misshaped_predictor_file_is_named(pwri, tmp_path):
    fc = _fc_tensors()
    fc["blk.1.fc2.weight"] = fc["blk.1.fc2.weight"][:, :8].copy()  # rank 8, fc1 says 16
    pred = _write_predictor_file(tmp_path / "p.gguf", fc, 0.0)
    cfg = read_config(pwri, open_gguf(pwri))
    with pytest.raises(ModelFileError, match=r"p\.gguf: predictor tensor blk\.1\.fc2\.weight has shape \(160, 8\), expected \(160, 16\)"):
        Predictors.load(pred, cfg)


def test_thresholds_and_predictor_together_is_one_clear_error(pwri):
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(pwri), "-p", "hi", "-n", "2",
                        "--sparsity", "0.5", "--predictor", str(pwri)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1
    assert r.stderr.startswith("error:") and "--predictor" in r.stderr and "Traceback" not in r.stderr
