"""scripts/make_bench_model.py on tiny shapes: the files hold what the tensor table says, in
llama.cpp's type mix; our engine loads the dense and the ReLU/PWRI outputs and generates; the
PWRI predictors mark about the requested fraction of neurons active."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.model.predictor import Predictors
from coordinator.runtime.sampling import SamplingParams
from sparsecore.config import read_config
from sparsecore.gguf_file import open_gguf
from tests.conftest import REPO, run_make_bench_model
from tests.fixtures.child_env import repo_env

sys.path.insert(0, str(REPO / "scripts"))
import make_bench_model as mbm  # noqa: E402

SCRIPT = REPO / "scripts" / "make_bench_model.py"
# 4 layers so Q4_K_M's use_more_bits picks some layers and not others
TINY = ["--shape", "tiny", "--layers", "4", "--quiet"]
OPTS = dict(cpu_workers=1, threads=1, gpu_share=0.0)
ACTIVE, ACTIVE_TOL = 0.1, 0.03  # requested fraction, and the absolute tolerance we accept


def _make(tmp_path, tiny_model, name, *extra) -> tuple[object, object]:
    out = tmp_path / name
    argv = [*TINY, "--tokenizer-from", str(tiny_model), "-o", str(out), *extra]
    r = run_make_bench_model(argv)
    assert r.stdout.startswith(f"wrote {out}: ") and " s\n" in r.stdout  # size and time printed
    return out, mbm.parse_args(argv)


def _types(path) -> dict[str, QT]:
    return {t.name: t.tensor_type for t in open_gguf(path).tensors}


def test_q4_k_m_mixes_types_like_llama_cpp(tmp_path, tiny_model):
    path, args = _make(tmp_path, tiny_model, "km.gguf", "--type", "q4_k_m")
    types = _types(path)
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K
    # use_more_bits(i, 4) = i < 0 or i >= 3 or i % 3 == 2: layers 2 and 3 get Q6_K
    for i in range(4):
        want = QT.Q6_K if i in (2, 3) else QT.Q4_K
        assert types[f"blk.{i}.ffn_down.weight"] == want and types[f"blk.{i}.attn_v.weight"] == want
        assert types[f"blk.{i}.ffn_gate.weight"] == types[f"blk.{i}.attn_q.weight"] == QT.Q4_K
        assert types[f"blk.{i}.ffn_norm.weight"] == QT.F32
    assert mbm.tensor_type("blk.0.ffn_up.weight", "q4_k_m", 5, 26, 3200) == QT.Q5_0  # 3200 % 256: fallback


def test_written_data_is_each_tensors_own(tmp_path, tiny_model):
    """Tensor by tensor writing kept table and data in step: every tensor dequantizes to the
    values its spec makes, within its type's rounding."""
    path, args = _make(tmp_path, tiny_model, "q4.gguf", "--type", "q4_0")
    args.vocab = len(open_gguf(tiny_model).fields["tokenizer.ggml.tokens"].contents())
    r = open_gguf(path)
    got = {t.name: t for t in r.tensors}
    specs = mbm.tensor_specs(args)
    assert [s.name for s in specs] == [t.name for t in r.tensors]
    for s in specs:
        t = got[s.name]
        assert t.tensor_type == s.qtype
        want = s.make()
        have = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
        tol = 0.02 if s.qtype == QT.F32 else 0.2 * np.abs(want).max()
        np.testing.assert_allclose(have, want, atol=tol, err_msg=s.name)
        if s.qtype != QT.F32:  # (norms are constant: no correlation to take)
            assert float(np.corrcoef(have.ravel(), want.ravel())[0, 1]) > 0.98, s.name


@pytest.mark.parametrize("ftype", ["q4_0", "q4_k_m"])
def test_engine_loads_and_generates_dense(tmp_path, tiny_model, ftype, no_leaks):
    path, _ = _make(tmp_path, tiny_model, f"{ftype}.gguf", "--type", ftype)
    with Engine(path, EngineOptions(**OPTS)) as eng:
        assert eng.cfg.activation == "silu" and eng.cfg.n_layers == 4 and eng.predictors is None
        ids = eng.tokenizer.encode("the quick brown fox")
        out = list(eng.generate(ids, 5, SamplingParams(0.0), stop_at_eos=False))
        logits = eng.forward_logits(ids)
    assert len(out) == 5
    assert np.isfinite(logits).all() and 0.1 < float(np.std(logits)) < 30  # activations stay O(1)


@pytest.fixture(scope="module")
def pwri(tmp_path_factory, tiny_model):
    return _make(tmp_path_factory.mktemp("pwri"), tiny_model, "relu.gguf", "--type", "q4_0", "--relu",
                 "--active", str(ACTIVE), "--rank", "64")


def test_relu_file_has_powerinfer_layout(pwri):
    path, args = pwri
    assert path.read_bytes()[:4] == b"PWRI"
    r = open_gguf(path)
    ne = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert ne["blk.0.ffn_down_t.weight"] == [args.hidden, args.n_ff]
    assert ne["blk.1.fc1.weight"] == [args.hidden, 64] and ne["blk.1.fc2.weight"] == [64, args.n_ff]
    assert not any(n.endswith("ffn_down.weight") for n in ne)
    assert _types(path)["blk.0.fc1.weight"] == QT.Q4_0
    cfg = read_config(path, r)
    assert cfg.activation == "relu" and cfg.sparse_threshold == 0.0


def test_relu_predictors_mark_the_requested_fraction(pwri):
    """On random residual rows of any scale (the score's sign does not depend on it)."""
    path, _ = pwri
    cfg = read_config(path, open_gguf(path))
    p = Predictors.load(path, cfg)
    g = torch.Generator().manual_seed(3)
    for scale in (0.1, 1.0, 30.0):
        h = torch.randn(256, cfg.hidden, generator=g) * scale
        frac = [float(p.masks(layer, h).mean()) for layer in range(cfg.n_layers)]
        assert all(abs(f - ACTIVE) < ACTIVE_TOL for f in frac), (scale, frac)


def test_engine_decodes_relu_file_with_its_predictors(pwri, no_leaks):
    path, args = pwri
    n = 8
    with Engine(path, EngineOptions(**OPTS)) as eng:
        assert eng.predictors is not None and eng.cfg.activation == "relu"
        ids = eng.tokenizer.encode("the quick brown fox jumps")
        out = list(eng.generate(ids, n, SamplingParams(0.0), stop_at_eos=False))
        active = dict(eng.ffn.stats.active)
    assert len(out) == n
    # prefill is dense; decode computes exactly the predicted neurons
    decoded = [(active[layer] - len(ids) * args.n_ff) / ((n - 1) * args.n_ff) for layer in range(args.n_layers)]
    assert abs(float(np.mean(decoded)) - ACTIVE) < ACTIVE_TOL, decoded


def test_types_that_need_an_importance_matrix_are_refused_in_one_line(tmp_path, tiny_model):
    r = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--type", "iq2_xs", "-o", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "importance matrix" in r.stderr.splitlines()[-1]
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(SystemExit):  # our writer does not make llama.cpp's other types itself
        mbm.parse_args([*TINY, "--type", "q3_k_m", "--quantizer", "own"])
    assert mbm.parse_args([*TINY, "--type", "q3_k_m"]).quantizer == "llama"
    assert mbm.parse_args([*TINY, "--type", "q4_0"]).quantizer == "own"


def _refused_without_llama_cpp(tmp_path, tiny_model, env=None) -> None:
    """--type q3_k_m where llama_cpp cannot be imported: one line saying what to install, status
    1, and no file left (not even the f16 one the quantizer would have read)."""
    r = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--tokenizer-from", str(tiny_model), "--type", "q3_k_m",
                        "-o", str(tmp_path / "q3km.gguf")], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "install llama-cpp-python (scripts/setup-bench)" in lines[0], r.stderr
    assert not list(tmp_path.glob("q3km.gguf*"))


def test_without_llama_cpp_its_types_are_refused_in_one_line(tmp_path, tiny_model):
    """llama_cpp shadowed by a package that fails to import (what a machine without
    llama-cpp-python gives), wherever the suite runs."""
    shadow = tmp_path / "shadow" / "llama_cpp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("no llama-cpp-python here")\n')
    env = repo_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow.parent), env.get("PYTHONPATH", "")])
    _refused_without_llama_cpp(tmp_path, tiny_model, env)


def test_llama_cpp_types_are_made_by_its_quantizer_and_load(tmp_path, tiny_model):
    """Where llama-cpp-python is installed (scripts/setup-bench), its quantizer makes the file
    and the engine loads it; where it is not (CI), the one-line refusal above."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        _refused_without_llama_cpp(tmp_path, tiny_model)
        return
    path, _ = _make(tmp_path, tiny_model, "q3km.gguf", "--type", "q3_k_m")
    types = set(_types(path).values())
    assert QT.Q3_K in types and not (tmp_path / "q3km.gguf.f16.tmp").exists()
    with Engine(path, EngineOptions(**OPTS)) as eng:
        assert len(list(eng.generate([1, 2, 3], 3, stop_at_eos=False))) == 3


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3", "qwen3moe"])
def test_arch_files_carry_their_attention_and_decode_natively(tmp_path, tiny_model, arch, no_leaks):
    """--arch writes the family's extra tensors and keys; the engine reads the file as that
    architecture and decodes it on the native attention path (not torch's)."""
    path, _ = _make(tmp_path, tiny_model, f"{arch}.gguf", "--type", "q4_0", "--arch", arch)
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    cfg = read_config(path, reader)
    assert cfg.arch == arch and cfg.native_attention
    assert cfg.qkv_bias == ("blk.0.attn_v.bias" in names) == (arch == "qwen2")
    assert cfg.qk_norm == ("blk.0.attn_k_norm.weight" in names) == (arch != "qwen2")
    assert cfg.routed == ("blk.0.ffn_down_exps.weight" in names) == (arch == "qwen3moe")
    if cfg.routed:  # the defaults: 8 experts of a quarter of the shape's FFN, 2 used
        assert (cfg.n_experts, cfg.n_experts_used, cfg.n_ff) == (8, 2, 128)
    assert cfg.post_norms == (arch == "gemma3") and cfg.tied_embeddings == (arch == "gemma3")
    if arch == "gemma3":
        assert cfg.sliding_window == 512 and cfg.activation == "gelu_tanh"
    with Engine(path, EngineOptions(weights="gguf", **OPTS)) as eng:
        assert eng.model.decode_plan.path.value != "torch"
        assert all(step is not None for step in eng.model.native)
        out = list(eng.generate([1, 2, 3], 4, SamplingParams(temperature=0.0), stop_at_eos=False))
        logits = eng.forward_logits([1, 2, 3])
    assert len(out) == 4
    assert np.isfinite(logits).all() and 0.1 < float(np.std(logits)) < 30  # activations stay O(1)


def test_moe_file_in_q4_k_m_with_a_skewed_router(tmp_path, tiny_model, no_leaks):
    """--arch qwen3moe --type q4_k_m: experts in llama.cpp's Q4_K_M mix (down's more-bits layers
    included, or their fallback where a row is not 256 wide), and --router-skew scales each
    router row by (rank + 1)^-skew against the same seed's unskewed file; the engine decodes it."""
    plain, _ = _make(tmp_path, tiny_model, "moe.gguf", "--type", "q4_k_m", "--arch", "qwen3moe")
    skewed, _ = _make(tmp_path, tiny_model, "skew.gguf", "--type", "q4_k_m", "--arch", "qwen3moe",
                      "--router-skew", "0.35")
    types = _types(skewed)
    assert types["blk.0.ffn_gate_exps.weight"] == QT.Q4_K  # 256-wide rows
    assert types["blk.0.ffn_down_exps.weight"] in (QT.Q5_0, QT.Q8_0)  # 128-wide rows: the K-quants' fallback
    for layer in range(4):
        name = f"blk.{layer}.ffn_gate_inp.weight"
        a = np.asarray(next(t for t in open_gguf(plain).tensors if t.name == name).data)
        b = np.asarray(next(t for t in open_gguf(skewed).tensors if t.name == name).data)
        scale = np.sort((np.linalg.norm(b, axis=1) / np.linalg.norm(a, axis=1)))[::-1]
        np.testing.assert_allclose(scale, np.arange(1, 9) ** -0.35, rtol=1e-5)
    with Engine(skewed, EngineOptions(**OPTS)) as eng:
        out = list(eng.generate([1, 2, 3], 4, SamplingParams(temperature=0.0), stop_at_eos=False))
    assert len(out) == 4
