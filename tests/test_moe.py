"""Mixture-of-experts models (routed FFNs: sparsecore/arch.py FFN_KINDS, sparsecore/shard.py
ExpertsLayer) against transformers, through the real coordinator and worker processes.

The tiny qwen3moe, Mixtral and qwen2moe models (tests/fixtures/tiny_arch.py: 8 experts, 2 chosen,
64 neurons each; qwen2moe's shared expert 128) are written as llama.cpp's converter writes
Qwen3-30B-A3B, Mixtral (a `llama` file with Q/K permuted) and Qwen1.5-MoE (stacked ffn_*_exps,
the router as ffn_gate_inp, the shared expert as ffn_*_shexp and its gate ffn_gate_inp_shexp),
and OLMoE (Q/K norms over every head: tests/test_olmoe.py).
scripts/make_arch_reference.py ran transformers' Qwen3MoeForCausalLM (norm_topk_prob, llama.cpp's
qwen3moe flag), MixtralForCausalLM, Qwen2MoeForCausalLM and OlmoeForCausalLM (no renormalization) on the same
weights and recorded the smallest gap between a token's k-th and (k+1)-th router probability and
logit (at least 0.001 and 0.007, against float differences of about 1e-6; Mixtral's,
qwen2moe's and olmoe's seeds were chosen for it): no near-tie decides a route. Exact arithmetic; ids must
match, logits within LOGITS_ATOL.
"""
from __future__ import annotations


import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.sampling import SamplingParams
from sparsecore.config import read_config
from sparsecore.errors import ModelFileError
from sparsecore.gguf_file import open_gguf
from sparsecore.kernels import FileMatrix
from tests.conftest import run_make_bench_model
from tests.fixtures.arch_oracle import REF, assert_matches, reference_logits, tiny_models
from tests.fixtures.decoding import assert_batch_is_alone
from tests.fixtures.tiny_arch import MOE, N_EXPERTS, N_FF_EXPERT, N_USED, write_tiny_arch
from tests.fixtures.tiny_gguf import copy_fields, write_gguf

@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("moe"), MOE)


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_transformers_gguf_loader_reads_back_the_tiny_files_exactly(arch):
    """The tiny qwen2moe and qwen3moe files, read back by transformers' own GGUF loader (scripts/
    make_arch_reference.py records it): every tensor the transformers model holds equals the
    weights the file was written from, so the writer's names and layouts (the stacked experts,
    the shared expert and its gate) are right by an implementation that is not ours."""
    rb = REF["gguf_readback"][arch]
    assert rb["tensors"] == rb["read"] and rb["tensors"] >= 20 and rb["max_abs_diff"] == 0.0


def test_the_reference_routes_with_a_margin():
    for arch in MOE:  # probabilities and logits: the engine's floats differ from transformers' by ~1e-6
        assert min(c["min_route_gap"] for c in REF["archs"][arch]) > 1e-3
        assert min(c["min_route_logit_gap"] for c in REF["archs"][arch]) > 1e-3


@pytest.mark.parametrize("arch", MOE)
def test_config_reads_the_experts(moe_models, arch):
    cfg = read_config(moe_models[arch], open_gguf(moe_models[arch]))
    assert cfg.routed and (cfg.n_experts, cfg.n_experts_used, cfg.n_ff) == (N_EXPERTS, N_USED, N_FF_EXPERT)
    assert cfg.native_attention and cfg.qk_norm == (arch in ("qwen3moe", "olmoe")) and cfg.qkv_bias == (arch == "qwen2moe")
    assert cfg.qk_norm_full == (arch == "olmoe")  # over every head, not per head
    # llama.cpp renormalizes qwen3moe's and Mixtral's top k only
    assert cfg.expert_norm == (arch not in ("qwen2moe", "olmoe"))
    assert cfg.n_ff_shared == (2 * N_FF_EXPERT if arch == "qwen2moe" else 0)
    assert cfg.arch == ("llama" if arch == "mixtral" else arch) and cfg.permuted_qk == (arch == "mixtral")


@pytest.mark.parametrize("split", ["dealt", "ranges"])
@pytest.mark.parametrize("share,path", [(None, "auto"), (None, "split"), (None, "lockstep"), (0.0, "auto")],
                         ids=["coordinator+worker", "split-attention", "lockstep", "worker-alone"])
@pytest.mark.parametrize("arch", MOE)
def test_greedy_and_logits_match_transformers(moe_models, arch, share, path, split, no_leaks, monkeypatch):
    """Two processes deal each token's chosen experts, each computing its experts whole (dealt),
    or each computes its range of every chosen expert's neurons (64 split 32 / 32: ranges),
    routing each token itself; prompts group their tokens by expert."""
    monkeypatch.setenv("SPARSEINFER_EXPERT_SPLIT", split)
    cases = REF["archs"][arch]
    opts = EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=False, decode_path=path, kv_caches=2,
                         coordinator_share=share, adaptive_spin=False if path == "lockstep" else None)
    with Engine(moe_models[arch], opts) as eng:
        owned = [sum(len(n) for n in s.neurons) for s in eng.plan.shards]
        assert sum(owned) == eng.cfg.n_layers * N_FF_EXPERT
        assert sum(1 for n in owned if n) == (1 if share == 0.0 else 2)  # split where there is a share
        assert len(eng.dealt) == (2 if split == "dealt" and share != 0.0 else 0)
        assert eng.model.decode_plan.path.value == {"auto": eng.model.decode_plan.path.value, "split": "split attention",
                                                    "lockstep": "lockstep"}[path]
        assert_matches(eng, arch)
        decoded = sum(len(c["generated_ids"]) - 1 for c in cases)
        assert len(eng.ffn.stats.lockstep_us) == (decoded if path == "lockstep" else 0)


def test_fast_arithmetic_decodes_close_to_exact(moe_models, no_leaks):
    """Fast mode (8-bit activations, interleaved rows) on the experts: the same greedy start as
    the exact reference on this F32 file, logits close."""
    case = REF["archs"]["qwen3moe"][0]
    with Engine(moe_models["qwen3moe"], EngineOptions(cpu_workers=1, threads=2, fast=True)) as eng:
        logits = eng.forward_logits(case["prompt_ids"])
    want = reference_logits("qwen3moe")[: len(case["prompt_ids"])]
    assert float(np.abs(logits - want).max()) < 0.05 * float(np.abs(want).max())


@pytest.mark.parametrize("opt,word", [(dict(predictor="predictor.gguf"), "--predictor"),
                                      (dict(sparsity=0.5), "--sparse-method input")])
def test_what_experts_do_not_run_with_is_refused_in_one_line(moe_models, opt, word):
    with pytest.raises(ValueError) as e:
        Engine(moe_models["qwen3moe"], EngineOptions(cpu_workers=1, threads=2, **opt), plan_only=True)
    assert word in str(e.value) and "mixture-of-experts" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("arch,key,value,word", [
    ("qwen3moe", "qwen3moe.expert_used_count", 9, "expert_used_count = 9"),
    ("qwen3moe", "qwen3moe.expert_count", 0, "expert_count = 0"),
    ("qwen2moe", "qwen2moe.expert_shared_feed_forward_length", 96, "must be a multiple of")])
def test_expert_metadata_out_of_range_is_one_line_naming_the_key(tmp_path, arch, key, value, word):
    import gguf

    src = write_tiny_arch(tmp_path / "ok.gguf", arch)
    reader = open_gguf(src)
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", arch)
    copy_fields(reader, w, {key: value})
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    write_gguf(w)
    with pytest.raises(ModelFileError) as e:
        read_config(tmp_path / "bad.gguf", open_gguf(tmp_path / "bad.gguf"))
    assert word in str(e.value) and "\n" not in str(e.value)


def test_generate_on_experts_suggests_calibrating_once(moe_models, no_leaks):
    """`generate` on an uncalibrated mixture-of-experts file decodes densely and says how to
    calibrate it (its experts take CATS levels: tests/test_moe_sparsity.py)."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.fixtures.child_env import repo_env

    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "-m", str(moe_models["qwen3moe"]), "-p",
                        "Hello", "-n", "3"], capture_output=True, text=True, timeout=300, cwd=REPO, env=repo_env())
    assert r.returncode == 0, r.stderr
    assert "decode 2 tok" in r.stderr and "sparseinfer calibrate -m" in r.stderr


def test_experts_of_a_type_without_kernels_are_converted_and_run(tmp_path, tiny_model, capfd, no_leaks):
    """Experts in a type the kernels cannot read (TQ2_0 here, like the 1- and 2-bit i-quants
    big MoE files come in) are requantized at load, one expert's slice at a time, said in one
    line, and decode; a dense check: the same file in Q8_0 decodes the same first token."""
    import gguf
    from gguf.quants import dequantize, quantize

    from tests.conftest import run_make_bench_model

    src = tmp_path / "moe.gguf"
    run_make_bench_model(["--shape", "tiny", "--layers", "2", "--quiet", "--tokenizer-from", str(tiny_model), "-o",
                          str(src), "--type", "q8_0", "--arch", "qwen3moe"])
    reader = open_gguf(src)
    w = gguf.GGUFWriter(tmp_path / "tq2.gguf", "qwen3moe")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), vt)
    for t in reader.tensors:  # the data as the reader shapes it: rows of block bytes, the writer's raw form
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):  # 256-wide rows: TQ2_0 takes them
            values = dequantize(np.asarray(t.data), t.tensor_type)
            w.add_tensor(t.name, quantize(values, gguf.GGMLQuantizationType.TQ2_0),
                         raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    write_gguf(w)
    with Engine(tmp_path / "tq2.gguf", EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        out = list(eng.generate([1, 2, 3], 3, SamplingParams(temperature=0.0), stop_at_eos=False))
        assert "TQ2_0" in eng.memory.converted_types
    assert len(out) == 3 and all(0 <= t < 49152 for t in out)
    err = capfd.readouterr().err
    assert "TQ2_0 tensors" in err and "requantized once at load" in err


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_a_continuous_batch_decodes_each_sequence_as_alone_bit_for_bit(moe_models, arch, fast, no_leaks):
    """Sequences decoded together share each chosen expert's rows (tokens grouped by expert), and
    every row's logits equal its sequence's decoded alone, bit for bit."""
    prompts = [c["prompt_ids"] for c in REF["archs"][arch]] + [[5, 6, 7, 8, 9]]
    # every cache in the shared pool, as the server sizes it: a private cache's attention is not
    # split across the processes, so it would be summed in another order
    opts = EngineOptions(cpu_workers=1, threads=2, fast=fast, kv_caches=2 * len(prompts) + 1)
    with Engine(moe_models[arch], opts) as eng:
        assert len(eng.dealt) == 2  # the two processes deal each token's experts
        assert_batch_is_alone(eng.model, prompts)


def test_profile_counts_routes_and_placement_predicts_the_routed_share(tmp_path, tiny_model, no_leaks):
    """`sparseinfer profile` on a routed model counts how often each expert is chosen, routing each
    FFN input as the engine does; `info --vram-budget` places the most-routed experts and predicts
    their share of the routed work. On a file whose router favours some experts (--router-skew),
    the share predicted from the calibration half of the text is what the held-out half's
    routes give, within 5 points."""
    from coordinator.runtime.placement import expert_placement, routed_share
    from coordinator.tools import corpus, profile
    from sparsecore.experts import route

    path = tmp_path / "skew.gguf"
    run_make_bench_model(["--shape", "tiny", "--layers", "2", "--quiet", "--type", "q8_0", "--arch", "qwen3moe",
                          "--router-skew", "0.5", "--tokenizer-from", str(tiny_model), "-o", str(path)])
    with Engine(path, EngineOptions(threads=2, cpu_workers=1)) as eng:
        cfg = eng.cfg
        seen = []
        eng.ffn.observer = lambda layer, x, *_: seen.append((layer, np.array(x)))
        eng.forward_logits([5, 6, 7, 8])
        eng.ffn.observer = None
        one = profile.collect(eng, [[5, 6, 7, 8]])
        ids = {}
        for layer, x in seen:
            router = FileMatrix(eng.store.info(f"blk.{layer}.ffn_gate_inp.weight"))
            ids[layer] = route(router, x, cfg.n_experts_used, cfg.expert_norm)[0]
        for layer, f in enumerate(one.freqs):  # the counts are the routes, each token's k experts
            want = np.bincount(ids[layer].reshape(-1), minlength=cfg.n_experts) / 4
            np.testing.assert_allclose(f, want)
            assert f.sum() == pytest.approx(cfg.n_experts_used)
        text = eng.tokenizer.encode(corpus.default_text())
        halves = corpus.token_chunks(text[:len(text) // 2], 64, 8), corpus.token_chunks(text[len(text) // 2:], 64, 8)
        calib, held = (profile.collect(eng, h) for h in halves)
    assert calib.meta["unit"] == "expert" and calib.meta["tokens"] == 8 * 64
    expert_bytes = 1000
    quarter = cfg.n_layers * cfg.n_experts // 4 * expert_bytes
    placed = expert_placement(calib.freqs, expert_bytes, quarter)
    assert placed["placed"] == cfg.n_layers * cfg.n_experts // 4
    assert placed["predicted_share"] > 0.3  # skewed: the top quarter takes more than a quarter
    assert abs(placed["predicted_share"] - routed_share(held.freqs, placed["experts"])) < 0.05
