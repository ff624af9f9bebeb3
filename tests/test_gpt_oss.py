"""gpt-oss (sparsecore/arch.py; llama.cpp's LLM_ARCH_OPENAI_MOE) against transformers'
GptOssForCausalLM, through the real coordinator and worker processes.

The tiny model (tests/fixtures/tiny_gpt_oss.py: 4 layers, the even ones within a window of 8,
8 experts with biases, 2 chosen, 64 neurons each, MXFP4 as the converter writes them, YaRN
rope, sinks) and its reference (scripts/make_arch_reference.py gpt-oss, seed chosen for a gap
of 0.011 between the router's k-th and (k+1)-th logits). Exact arithmetic: ids equal, logits
within LOGITS_ATOL. Each test here breaks where its piece does: the unit tests show that the
piece changes the result (the clamp is met, the sinks and the untruncated YaRN range matter).
"""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from sparsecore.config import read_config
from sparsecore.errors import ModelFileError
from sparsecore.gguf_file import open_gguf
from tests.fixtures.arch_oracle import REF, assert_matches, reference_logits
from tests.fixtures.decoding import assert_batch_is_alone
from tests.fixtures.tiny_gpt_oss import (N_EXPERTS, N_FF_EXPERT, N_LAYERS, N_USED, WINDOW, YARN, gguf_tensors,
                                         write_tiny_gpt_oss)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "tiny-gpt-oss.gguf")


def test_the_reference_routes_with_a_margin():
    """Routing is on the router's logits (the top k, then their softmax): their gap decides."""
    cases = REF["archs"]["gpt-oss"]
    assert min(c["min_route_logit_gap"] for c in cases) > 5e-3 and min(c["min_margin"] for c in cases) > 1e-2


def test_config_reads_gpt_oss(model):
    cfg = read_config(model, open_gguf(model))
    assert cfg.routed and (cfg.n_experts, cfg.n_experts_used, cfg.n_ff) == (N_EXPERTS, N_USED, N_FF_EXPERT)
    assert cfg.expert_gating == "softmax_weight" and cfg.expert_bias and cfg.swiglu_limit == 7.0
    assert cfg.attn_sinks and cfg.attn_out_bias and cfg.qkv_bias and not cfg.permuted_qk and not cfg.post_norms
    assert [cfg.layer_window(i) for i in range(N_LAYERS)] == [WINDOW, None, WINDOW, None]  # even layers slide
    factor, orig, fast, slow, attn, truncate = cfg.rope_yarn
    assert (factor, orig, fast, slow, truncate) == (YARN["factor"], YARN["original_max_position_embeddings"],
                                                    32.0, 1.0, False)
    assert attn == pytest.approx(0.1 * np.log(32.0) + 1.0)


def test_the_ffn_norm_is_post_attention_norm_and_no_output_norm(model):
    """The converter names gpt-oss's FFN input norm post_attention_norm: it is the FFN's norm here,
    not also a norm of the attention output (gemma3's meaning of the name)."""
    from sparsecore.tensors import TensorStore

    store = TensorStore(model, open_gguf(model))
    assert store.has("blk.0.ffn_norm.weight") and not store.has("blk.0.post_attention_norm.weight")
    np.testing.assert_array_equal(store.matrix("blk.0.ffn_norm.weight"),
                                  gguf_tensors()["blk.0.post_attention_norm.weight"])


@pytest.mark.parametrize("split", ["dealt", "ranges"])
@pytest.mark.parametrize("share,path", [(None, "auto"), (None, "split"), (None, "lockstep"), (0.0, "auto")],
                         ids=["coordinator+worker", "split-attention", "lockstep", "worker-alone"])
def test_greedy_and_logits_match_transformers(model, share, path, split, no_leaks, monkeypatch):
    """Two processes deal each token's chosen experts, each expert whole with its down bias
    (dealt), or each computes its range of every chosen expert's neurons (32 / 32 with a worker;
    the down bias once, by the range that starts the expert: ranges), routing each token itself;
    the attention is the native step's (sinks, the output bias once, by the share of head 0; the
    even layers' window), split by heads across the processes or in lockstep where asked."""
    monkeypatch.setenv("SPARSEINFER_EXPERT_SPLIT", split)
    opts = EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=False, kv_caches=2, coordinator_share=share,
                         decode_path=path, adaptive_spin=False if path == "lockstep" else None)
    with Engine(model, opts) as eng:
        owned = [sum(len(n) for n in s.neurons) for s in eng.plan.shards]
        assert sum(owned) == N_LAYERS * N_FF_EXPERT and sum(1 for n in owned if n) == (1 if share == 0.0 else 2)
        assert len(eng.dealt) == (2 if split == "dealt" and share != 0.0 else 0)
        assert all(step is not None for step in eng.model.native)  # no layer on the torch path
        assert eng.model.decode_plan.path.value == {"auto": eng.model.decode_plan.path.value, "split": "split attention",
                                                    "lockstep": "lockstep"}[path]
        assert_matches(eng, "gpt-oss")
        decoded = sum(len(c["generated_ids"]) - 1 for c in REF["archs"]["gpt-oss"])
        assert len(eng.ffn.stats.lockstep_us) == (decoded if path == "lockstep" else 0)


def test_native_attention_with_sinks_at_every_level(model, isa, no_leaks):
    """The coordinator's native attention steps (this process, at each ISA level the CPU runs:
    the portable softmax and the SIMD ones each add the sinks to their denominators)."""
    opts = EngineOptions(cpu_workers=1, threads=2, fast=False, coordinator_share=0.0)
    with Engine(model, opts) as eng:
        assert all(step is not None for step in eng.model.native)
        assert_matches(eng, "gpt-oss")


def test_fast_arithmetic_decodes_close_to_exact(model, no_leaks):
    """Fast mode (8-bit activations into the experts' MXFP4 products): logits close."""
    case = REF["archs"]["gpt-oss"][0]
    with Engine(model, EngineOptions(cpu_workers=1, threads=2, fast=True)) as eng:
        logits = eng.forward_logits(case["prompt_ids"])
    want = reference_logits("gpt-oss")[: len(case["prompt_ids"])]
    assert float(np.abs(logits - want).max()) < 0.05 * float(np.abs(want).max())


def test_a_continuous_batch_decodes_each_sequence_as_alone_bit_for_bit(model, no_leaks):
    prompts = [c["prompt_ids"] for c in REF["archs"]["gpt-oss"]] + [[5, 6, 7, 8, 9]]
    with Engine(model, EngineOptions(cpu_workers=1, threads=2, fast=False, kv_caches=2 * len(prompts) + 1)) as eng:
        assert len(eng.dealt) == 2  # each process computes its dealt experts whole
        assert_batch_is_alone(eng.model, prompts)


def test_fast_mode_interleaves_the_experts_and_a_batch_decodes_each_as_alone(model, no_leaks, monkeypatch):
    """Fast mode holds the experts' MXFP4 rows interleaved 16 by 16 (X16) in every process where
    the level has tiles (the best SIMD level this CPU runs; none: the file's rows), decodes
    close to exact, and a continuous batch still gives each sequence its lone tokens bit for bit
    (the tiles give a token alone what they give it in a batch)."""
    from sparsecore import kernels as K
    from sparsecore.oai_experts import OaiExpertsLayer
    from tests.conftest import runnable_isas

    simd = [level for level in runnable_isas() if level in K.SIMD_LEVELS]
    level, default = (simd[-1] if simd else "generic"), K.isa()
    monkeypatch.setenv("SPARSEINFER_ISA", level)  # the worker's level too
    K.set_isa(level)
    prompts = [c["prompt_ids"] for c in REF["archs"]["gpt-oss"]] + [[5, 6, 7, 8, 9]]
    try:
        with Engine(model, EngineOptions(cpu_workers=1, threads=2, fast=True, kv_caches=2 * len(prompts) + 1)) as eng:
            routed = [w for w in eng.ffn.own.layers.values() if isinstance(w, OaiExpertsLayer)]
            mats = [m for w in routed for e in w.experts if e is not None for m in (e.gate, e.up, e.down)]
            assert routed and mats and all(m.interleaved == bool(simd) for m in mats)
            case = REF["archs"]["gpt-oss"][0]
            logits = eng.forward_logits(case["prompt_ids"])
            want = reference_logits("gpt-oss")[: len(case["prompt_ids"])]
            assert float(np.abs(logits - want).max()) < 0.05 * float(np.abs(want).max())
            assert_batch_is_alone(eng.model, prompts)
    finally:
        K.set_isa(default)


def test_experts_match_transformers_layer_and_the_clamp_is_met(model):
    """One routed layer over every expert's whole range (a process alone) against transformers'
    GptOssMLP on the same weights, on inputs where the SwiGLU's clamp at 7 is met by many
    neurons (so a missing clamp, a bias or the gating's order would show)."""
    import torch  # transformers is a test dependency (pyproject's test extra): no skip where it is missing
    import transformers
    from sparsecore.kernels import FfnScratch
    from sparsecore.oai_experts import OaiExpertsLayer
    from sparsecore.tensors import TensorStore
    from tests.fixtures.tiny_gpt_oss import hf_config, hf_weights

    cfg = read_config(model, open_gguf(model))
    store = TensorStore(model, open_gguf(model))
    layer = OaiExpertsLayer(store, 1, range(0, N_FF_EXPERT), False, FfnScratch(cfg.hidden, N_FF_EXPERT), cfg)
    x = np.random.default_rng(3).standard_normal((6, cfg.hidden)).astype(np.float32)
    got = layer.step(x, "silu", None, None)[0]
    hc = transformers.GptOssConfig(**hf_config(), experts_implementation="eager")
    mlp = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(hc).float().eval()
    w = hf_weights()
    mlp.load_state_dict({k[len("model.layers.1.mlp."):]: torch.from_numpy(v) for k, v in w.items()
                         if k.startswith("model.layers.1.mlp.")})
    with torch.inference_mode():
        want = mlp(torch.from_numpy(x)[None])[0][0].numpy()
        gate_up = torch.einsum("th,ehf->tef", torch.from_numpy(x), mlp.experts.gate_up_proj) + mlp.experts.gate_up_proj_bias
    assert float(np.abs(got - want).max()) < 1e-4 * max(1.0, float(np.abs(want).max()))
    assert int((gate_up[..., 0::2] > 7).sum()) > 10 and int((gate_up[..., 1::2].abs() > 7).sum()) > 10
    unclamped = OaiExpertsLayer(store, 1, range(0, N_FF_EXPERT), False, FfnScratch(cfg.hidden, N_FF_EXPERT), cfg)
    unclamped.limit = 1e9  # before its first step: the kernels' records take it then
    assert float(np.abs(unclamped.step(x, "silu", None, None)[0] - want).max()) > 1e-2
    # a prompt longer than a small batch: the tokens grouped by expert over it (numpy's SwiGLU)
    xl = np.random.default_rng(4).standard_normal((40, cfg.hidden)).astype(np.float32)
    with torch.inference_mode():
        want_l = mlp(torch.from_numpy(xl)[None])[0][0].numpy()
    got_l = layer.step(xl, "silu", None, None)[0]
    assert float(np.abs(got_l - want_l).max()) < 1e-4 * max(1.0, float(np.abs(want_l).max()))


def test_the_oai_activation_without_its_biases_is_refused_in_one_line(model):
    """gpt-oss's activation reads each expert's biases from the FFN record: a record without
    them is refused by the kernel's entry, not read through a null pointer."""
    from sparsecore import kernels as K
    from sparsecore.tensors import TensorStore

    store = TensorStore(model, open_gguf(model))
    gate, up, down = (K.FileMatrix(store.expert(f"blk.0.ffn_{n}_exps.weight", 0)) for n in ("gate", "up", "down"))
    x = np.ones(gate.cols, np.float32)
    with pytest.raises(ValueError) as e:
        K.ffn_token(gate, up, down, x, range(0, gate.rows), "swiglu_oai", K.FfnScratch(gate.cols, gate.rows))
    assert "biases" in str(e.value) and "\n" not in str(e.value)
    y, n = K.ffn_token(gate, up, down, x, range(0, gate.rows), "silu", K.FfnScratch(gate.cols, gate.rows))
    assert n == gate.rows and np.isfinite(y).all()


def test_yarn_tables_match_transformers_and_truncation_matters():
    import torch
    import transformers

    from sparsecore.rope import rope_tables
    from tests.fixtures.tiny_gpt_oss import HEAD_DIM, ROPE_BASE, hf_config

    hc = transformers.GptOssConfig(**hf_config())
    rot = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hc)
    cos_t, sin_t = rot(torch.zeros(1), torch.arange(64)[None])
    yarn = (YARN["factor"], YARN["original_max_position_embeddings"], 32.0, 1.0, rot.attention_scaling, False)
    cos, sin = rope_tables(ROPE_BASE, 1.0, HEAD_DIM, 64, yarn=yarn)
    np.testing.assert_allclose(cos[:, :HEAD_DIM // 2], cos_t[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(sin[:, HEAD_DIM // 2:], sin_t[0].numpy(), atol=2e-6)
    truncated = rope_tables(ROPE_BASE, 1.0, HEAD_DIM, 64, yarn=yarn[:-1] + (True,))[0]
    assert float(np.abs(truncated - cos).max()) > 1e-2


def test_sinks_change_the_logits(model, tmp_path, no_leaks):
    """The same file with every sink at -1e4 (no weight left to them) is another model."""
    import gguf

    from tests.fixtures.tiny_gguf import copy_fields, write_gguf

    reader = open_gguf(model)
    w = gguf.GGUFWriter(tmp_path / "nosink.gguf", "gpt-oss")
    copy_fields(reader, w)
    for t in reader.tensors:
        data = np.full_like(np.asarray(t.data), -1e4) if t.name.endswith("attn_sinks.weight") else np.asarray(t.data)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    write_gguf(w)
    case = REF["archs"]["gpt-oss"][0]
    with Engine(tmp_path / "nosink.gguf", EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        logits = eng.forward_logits(case["prompt_ids"])
    assert float(np.abs(logits - reference_logits("gpt-oss")[: len(case["prompt_ids"])]).max()) > 1e-2


@pytest.mark.parametrize("drop,word", [("rope.scaling.factor", "gpt-oss.rope.scaling.factor"),
                                       ("rope.scaling.original_context_length",
                                        "gpt-oss.rope.scaling.original_context_length"),
                                       ("attention.sliding_window", "gpt-oss.attention.sliding_window"),
                                       ("expert_count", "gpt-oss.expert_count")])
def test_missing_metadata_is_one_line_naming_the_key(tmp_path, drop, word):
    path = write_tiny_gpt_oss(tmp_path / "bad.gguf", drop=(drop,))
    with pytest.raises(ModelFileError) as e:
        read_config(path, open_gguf(path))
    assert word in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tensor,shape", [("blk.1.attn_sinks.weight", (3,)), ("blk.0.ffn_down_exps.bias", (8, 32))])
def test_tensors_inconsistent_with_the_metadata_are_one_line(model, tmp_path, tensor, shape):
    import gguf

    from tests.fixtures.tiny_gguf import copy_fields, write_gguf

    reader = open_gguf(model)
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", "gpt-oss")
    copy_fields(reader, w)
    for t in reader.tensors:
        data = np.zeros(shape, np.float32) if t.name == tensor else np.asarray(t.data)
        w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.F32 if t.name == tensor else t.tensor_type)
    write_gguf(w)
    with pytest.raises(ModelFileError) as e:
        read_config(tmp_path / "bad.gguf", open_gguf(tmp_path / "bad.gguf"))
    assert tensor in str(e.value) and "\n" not in str(e.value)


def test_a_missing_sink_tensor_is_one_line(model, tmp_path):
    import gguf

    from tests.fixtures.tiny_gguf import copy_fields, write_gguf

    reader = open_gguf(model)
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", "gpt-oss")
    copy_fields(reader, w)
    for t in reader.tensors:
        if t.name != "blk.2.attn_sinks.weight":
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    write_gguf(w)
    with pytest.raises(ModelFileError) as e:
        Engine(tmp_path / "bad.gguf", EngineOptions(cpu_workers=1, threads=2), plan_only=True)
    assert "blk.2.attn_sinks.weight is missing" in str(e.value) and "\n" not in str(e.value)


def test_mxfp4_experts_stay_in_the_file_s_blocks(model, capfd, no_leaks):
    """MXFP4 is a native type (IQ4_NL's code paths with its codebook and E8M0 scale): the experts
    are read in place, nothing converted at load."""
    from sparsecore.kernels import supports
    from sparsecore.tensors import TensorStore

    store = TensorStore(model, open_gguf(model))
    assert supports(39) and store.expert("blk.0.ffn_up_exps.weight", 3).tensor_type == 39 and not store.converted
    with Engine(model, EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        eng.forward_logits([1, 2, 3])
        assert not eng.memory.converted_types
    assert "requantized" not in capfd.readouterr().err


def test_bench_file_decodes_as_llama_cpp_does(tmp_path, smollm2_path, no_leaks):
    """scripts/make_bench_model.py --arch gpt-oss (MXFP4 experts with biases, sinks, YaRN keys)
    writes a file the engine decodes natively, picking the greedy tokens llama.cpp picked on the
    same file (its own gpt-oss graph: an implementation that is not ours), recorded by
    scripts/make_llamacpp_reference.py: the file written now must be the one it read."""
    import hashlib

    from scripts.make_llamacpp_reference import GPT_OSS_BENCH_ARGS
    from tests.conftest import run_make_bench_model
    from tests.fixtures.arch_oracle import LLAMA_CPP_REF

    rec = LLAMA_CPP_REF["gpt-oss"]
    path = tmp_path / "gpt-oss.gguf"
    run_make_bench_model([*GPT_OSS_BENCH_ARGS, "--tokenizer-from", str(smollm2_path), "-o", str(path)])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["file_sha256"]
    types = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "MXFP4" and types["blk.1.attn_sinks.weight"] == "F32"
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        assert eng.cfg.arch == "gpt-oss" and all(s is not None for s in eng.model.native)
        got = list(eng.generate(rec["prompt"], len(rec["greedy"]), stop_at_eos=False))
    assert got == rec["greedy"]


def test_the_coordinator_decodes_without_importing_torch(model):
    """Every layer's attention on the native step and the experts on the native products: a
    coordinator that decodes gpt-oss never imports torch (about 1 s and a quarter GB)."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.fixtures.child_env import repo_env

    code = ("import sys\nfrom coordinator.runtime.engine import Engine, EngineOptions\n"
            f"with Engine({str(model)!r}, EngineOptions(cpu_workers=1, threads=2)) as eng:\n"
            "    print(len(list(eng.generate([5, 6, 7, 8, 9, 10, 11, 12, 13], 9, stop_at_eos=False))))\n"
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=repo_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["9", "False"]


def test_profile_counts_the_routes_the_engine_takes(model, no_leaks):
    """`sparseinfer profile` routes each FFN input with the router's bias, as the layers do."""
    from coordinator.tools import profile

    with Engine(model, EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        seen = []
        eng.ffn.observer = lambda layer, x, *_: seen.append((layer, np.array(x)))
        eng.forward_logits([5, 6, 7, 8])
        eng.ffn.observer = None
        freqs = profile.collect(eng, [[5, 6, 7, 8]]).freqs
        for layer, x in seen:  # float64 logits with the router's bias, the N_USED largest
            w, bias = (eng.store.matrix(f"blk.{layer}.ffn_gate_inp.{n}").astype(np.float64) for n in ("weight", "bias"))
            logits = x.astype(np.float64) @ w.reshape(-1, x.shape[1]).T + bias.reshape(-1)
            top = np.sort(logits, axis=1)[:, ::-1]
            assert (top[:, N_USED - 1] - top[:, N_USED] > 1e-4).all()  # no near-tie decides
            ids = np.argsort(-logits, axis=1, kind="stable")[:, :N_USED]
            np.testing.assert_allclose(freqs[layer], np.bincount(ids.reshape(-1), minlength=N_EXPERTS) / 4)
