"""The non-llama architectures (mistral with a sliding window, qwen2, qwen3, gemma3, phi3) against
transformers, through the real coordinator and worker processes.

Each tiny model (tests/fixtures/tiny_arch.py) is written in the layout llama.cpp's converter gives
it, from seeded weights; scripts/make_arch_reference.py loaded those same weights into the
transformers model class of the architecture and committed its greedy ids and logits
(tests/fixtures/arch_reference*.json/npz). Ids must match exactly; logits within LOGITS_ATOL
(measured: at most 8e-6 with logits up to about 10; the FFN is summed across processes in
another order than transformers sums it). Exact arithmetic throughout (fast=False; the engine's
default is llama.cpp's 8-bit activations).
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.model_files import load_thresholds, save_thresholds
from coordinator.runtime.sampling import SamplingParams
from coordinator.tools import corpus
from coordinator.tools.calibrate import calibrate
from coordinator.tools.perplexity import perplexity
from sparsecore.config import SUPPORTED_ARCHS, read_config
from sparsecore.errors import ModelFileError
from sparsecore.gguf_file import open_gguf
from tests.conftest import REPO
from tests.fixtures.arch_oracle import LOGITS_ATOL, REF, assert_matches, reference_logits, tiny_models
from tests.fixtures.tiny_arch import ARCHS
from tests.fixtures.tiny_gguf import write_gguf

@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("arch"), ARCHS)


@pytest.mark.parametrize("weights", ["gguf", "f32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logits_match_transformers(arch_models, arch, weights, no_leaks):
    with Engine(arch_models[arch], EngineOptions(cpu_workers=1, threads=2, weights=weights, fast=False)) as eng:
        assert_matches(eng, arch)


@pytest.mark.parametrize("path", ["lockstep", "split"])
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_split_across_processes_matches_transformers(arch_models, arch, path, no_leaks):
    """Every architecture's attention (biases, Q/K norms, output norms, windows, per-layer rope
    bases, falcon's LayerNorms and parallel blocks) on the native path with its heads split
    between the coordinator and the worker (falcon's one KV head: its query heads split):
    decoded tokens through every layer in one post (lockstep) or layer by layer, prompts split
    too (forced: the tiny layers would never pay for the exchange)."""
    opts = EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=False, decode_path=path, kv_caches=2,
                         adaptive_spin=False if path == "lockstep" else None)
    with Engine(arch_models[arch], opts) as eng:
        assert eng.model.decode_plan.path.value == ("lockstep" if path == "lockstep" else "split attention")
        assert_matches(eng, arch)
        decoded = sum(len(c["generated_ids"]) - 1 for c in REF["archs"][arch])
        assert len(eng.ffn.stats.lockstep_us) == (decoded if path == "lockstep" else 0)


@pytest.mark.parametrize("arch", ["falcon", "falcon40b"])
def test_falcon_attention_is_native_on_the_coordinator(arch_models, arch, no_leaks):
    """Falcon's LayerNorms (40B's two, attn_norm_2 the attention's) and parallel blocks in the
    native step with attention on the coordinator alone: the plan says native, every layer has
    a step, and transformers' tokens and logits come out."""
    opts = EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=False, split_attention=False)
    with Engine(arch_models[arch], opts) as eng:
        assert eng.model.decode_plan.path.value == "native"
        assert all(step is not None for step in eng.model.native)
        assert eng.model.split_attn is None
        assert_matches(eng, arch)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_the_sliding_window_is_what_makes_the_match(arch_models, arch, no_leaks):
    """Without the window, positions past it move away from transformers: the test above
    really checks the window (and, for gemma3, the global layer that keeps attending to all)."""
    case = REF["archs"][arch][0]
    seq = case["prompt_ids"] + case["generated_ids"]
    with Engine(arch_models[arch], EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        window = eng.cfg.sliding_window
        assert window is not None and window < len(seq)
        for L, step in zip(eng.model.layers, eng.model.native):
            L.window = None  # the torch path's (prompts the quality tools watch)
            if step is not None:  # the native step's, which decoded tokens and prompts take
                step.set_window(None)
        logits = eng.forward_logits(seq)
    diff = np.abs(logits - reference_logits(arch)).max(axis=1)
    assert diff[:window].max() < LOGITS_ATOL  # the window covers everything there
    assert diff[window:].max() > 1e-2


def test_configs_read_as_the_converter_writes_them(arch_models):
    def cfg(arch):
        return read_config(arch_models[arch], open_gguf(arch_models[arch]))
    g = cfg("gemma3")
    assert g.activation == "gelu_tanh" and g.post_norms and g.qk_norm and g.tied_embeddings
    assert g.sliding_layers == (True, True, True, True, True, False)  # llama.cpp's pattern of 6
    assert g.embed_scale == pytest.approx(8.0) and g.rope_base_swa == 10000.0 and g.rope_base == 1e6
    assert g.head_dim == 32 and g.sliding_window == 6
    p = cfg("phi3")
    assert p.rope_dim == 8 and p.sliding_window is None and not p.permuted_qk and p.activation == "silu"
    q2, q3, m = cfg("qwen2"), cfg("qwen3"), cfg("mistral")
    assert q2.qkv_bias and not q2.qk_norm and not q2.permuted_qk
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32
    assert m.permuted_qk and m.sliding_window == 8
    assert all(cfg(a).native_attention for a in ARCHS)
    f = cfg("falcon")
    assert f.layer_norm and f.parallel and f.n_kv_heads == 1


def test_other_architectures_get_one_line_naming_the_supported_ones(tmp_path):
    import gguf
    write_gguf(gguf.GGUFWriter(tmp_path / "falcon.gguf", "starcoder2"))
    with pytest.raises(ModelFileError) as e:
        read_config(tmp_path / "falcon.gguf", open_gguf(tmp_path / "falcon.gguf"))
    msg = str(e.value)
    assert "'starcoder2'" in msg and all(a in msg for a in SUPPORTED_ARCHS) and "\n" not in msg


@pytest.fixture(scope="module")
def calibrated(arch_models):
    """gemma3 (GeGLU: |gelu_tanh(gate x)| against the thresholds) and phi3 (gate and up fused in
    one tensor) calibrated at 0.5."""
    out = {}
    for arch in ("gemma3", "phi3"):
        path = arch_models[arch]
        with Engine(path, EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
            ids = eng.tokenizer.encode(corpus.load(None, "calibration")[:8000])
            table = calibrate(eng, corpus.token_chunks(ids, 64, 4), levels=(0.5,))
        save_thresholds(path, table)
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_sparsity_runs_and_hits_its_level(calibrated, arch, no_leaks):
    """Calibrated thresholds give the target share of inactive neurons on the calibration text,
    and sparse decoding gives the same tokens whether the FFN runs in the native kernels on the
    file's blocks (act_fn's gelu_tanh) or in torch on float copies (ffn.ACTIVATIONS)."""
    path = calibrated[arch]
    assert all(t > 0 for t in load_thresholds(path, 0.5))
    ids = REF["archs"][arch][0]["prompt_ids"]
    tokens = {}
    for weights in ("gguf", "f32"):
        with Engine(path, EngineOptions(cpu_workers=1, threads=2, sparsity=0.5, sparse_method="cats", weights=weights,
                                        fast=False)) as eng:
            text = eng.tokenizer.encode(corpus.load(None, "calibration")[:8000])
            r = perplexity(eng, corpus.token_chunks(text, 64, 4))
            assert r["active_fraction"] == pytest.approx(0.5, abs=0.03)
            tokens[weights] = list(eng.generate(ids, 12, SamplingParams(0.0), stop_at_eos=False))
            st = eng.ffn.stats
            assert max(st.active[l] / st.tokens[l] for l in st.active) < eng.cfg.n_ff
    assert tokens["gguf"] == tokens["f32"]


def test_generate_cli_sparse_on_gemma3(calibrated):
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(calibrated["gemma3"]), "-p",
                        "the quick brown fox", "-n", "8", "--sparsity", "0.5", "-t", "2"],
                       capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    # generate echoes the prompt: text after it is what was decoded
    assert r.stdout.startswith("the quick brown fox") and r.stdout[len("the quick brown fox"):].strip(), r.stdout
