"""SmallThinker (gguf arch `smallthinker`, PowerInfer's SmallThinker-4B-A0.6B / 21B-A3B) against
llama.cpp, its only oracle (transformers has no class for it), through the real coordinator and
worker processes.

The tiny model (tests/fixtures/tiny_smallthinker.py: 5 layers, 8 experts of 64 neurons, 2
chosen, sigmoid or softmax gating) was run by llama.cpp (llama-cpp-python, F32 KV cache) in
scripts/make_llamacpp_reference.py: its greedy tokens and every position's logits are recorded
(tests/fixtures/llama_cpp_reference.json, llama_cpp_reference_logits.npz) with the SHA-256 of the
file it read, which the file written here must have. Exact arithmetic: ids equal, logits within
LOGITS_ATOL (measured 2e-6 and 4.5e-6 with logits up to 4).

What the comparison breaks on (each checked by changing the engine once: logits off by 0.9 to 4.4):
the router scoring the FFN's input instead of the layer's; the file's window (4) instead of
llama.cpp's 4096; rope on the NoPE layers 0 and 4; the sliding layers at rope.freq_base instead of
rope.freq_base_swa; the top k not renormalized; SiLU instead of ReLU; the two gatings swapped.
"""
from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.sampling import SamplingParams
from sparsecore.config import read_config
from sparsecore.errors import ModelFileError
from sparsecore.experts import route
from sparsecore.gguf_file import open_gguf
from sparsecore.kernels import FileMatrix
from sparsecore.shard import FfnShard
from sparsecore.tensors import TensorStore
from tests.fixtures.arch_oracle import FIXTURES, LLAMA_CPP_REF
from tests.fixtures.decoding import assert_batch_is_alone
from tests.fixtures.tiny_smallthinker import (N_EXPERTS, N_FF_EXPERT, N_LAYERS, N_USED, PATTERNS, PROMPT, ROPE_BASE,
                                              ROPE_BASE_SWA, write_tiny_smallthinker)

GATINGS = ("sigmoid", "softmax")
REC = LLAMA_CPP_REF["smallthinker"]
LOGITS_ATOL = 1e-4


def llama_cpp_logits(gating: str) -> np.ndarray:
    return np.load(FIXTURES / "llama_cpp_reference_logits.npz")[f"smallthinker-{gating}"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("smallthinker")
    return {g: write_tiny_smallthinker(d / f"tiny-smallthinker-{g}.gguf", g) for g in GATINGS}


@pytest.mark.parametrize("gating", GATINGS)
def test_the_file_is_the_one_llama_cpp_read(models, gating):
    assert hashlib.sha256(models[gating].read_bytes()).hexdigest() == REC[gating]["file_sha256"]
    assert REC[gating]["prompt"] == PROMPT
    assert llama_cpp_logits(gating).shape[0] == len(PROMPT) + len(REC[gating]["greedy"])
    assert REC[gating]["min_margin"] > 1e-2  # no near-tie decides a greedy token


def test_config_reads_smallthinker(models):
    cfg = read_config(models["sigmoid"], open_gguf(models["sigmoid"]))
    assert cfg.routed and (cfg.n_experts, cfg.n_experts_used, cfg.n_ff) == (N_EXPERTS, N_USED, N_FF_EXPERT)
    assert cfg.expert_gating == "sigmoid" and cfg.expert_norm and cfg.router_reads_layer_input
    assert cfg.activation == "relu" and cfg.ffn_gate == "par" and not cfg.permuted_qk  # ReGLU, neox rope
    # the file says a window of 4: llama.cpp attends within 4096 on the sliding layers
    assert cfg.sliding_window == 4096
    assert [cfg.layer_window(i) for i in range(N_LAYERS)] == [None, 4096, 4096, 4096, None]
    assert [cfg.layer_has_rope(i) for i in range(N_LAYERS)] == [False, True, True, True, False]
    assert [cfg.layer_rope_base(i)[0] for i in range(1, 4)] == [ROPE_BASE_SWA] * 3
    assert cfg.native_attention
    softmax = read_config(models["softmax"], open_gguf(models["softmax"]))
    assert softmax.expert_gating == "softmax"


@pytest.mark.parametrize("n_layers,fields,sliding,rope", [
    # pattern 2: layers 0, 2, 4 global; NoPE stays every 4th layer (llama.cpp's step is not the pattern)
    (5, {"attention.sliding_window_pattern": 2}, [False, True, False, True, False], [False, True, True, True, False]),
    # pattern 0: every layer slides (set_swa_pattern's n_pattern == 0)
    (5, {"attention.sliding_window_pattern": 0}, [True] * 5, [False, True, True, True, False]),
    # exactly 4 layers: llama.cpp ropes every layer (n_no_rope_layer_step == n_layer)
    (4, {}, [False, True, True, True], [True] * 4),
    # no window (or 0): every layer global, with rope
    (5, {"attention.sliding_window": None}, [False] * 5, [True] * 5),
    (5, {"attention.sliding_window": 0}, [False] * 5, [True] * 5)],
    ids=["pattern-2", "pattern-0", "four-layers", "no-window", "window-0"])
def test_the_layer_pattern_is_llama_cpps(tmp_path, n_layers, fields, sliding, rope):
    path = write_tiny_smallthinker(tmp_path / "p.gguf", fields=fields, n_layers=n_layers)
    cfg = read_config(path, open_gguf(path))
    assert [cfg.layer_window(i) is not None for i in range(n_layers)] == sliding
    assert [cfg.layer_has_rope(i) for i in range(n_layers)] == rope
    # the sliding layers' base: rope.freq_base_swa; the global ones rope.freq_base
    assert [cfg.layer_rope_base(i)[0] for i in range(n_layers)] == [ROPE_BASE_SWA if s else ROPE_BASE
                                                                    for s in sliding]


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_other_layer_patterns_match_llama_cpp(tmp_path, pattern, no_leaks):
    """The files of other layer patterns (tiny_smallthinker.PATTERNS: another period, period 0,
    4 layers, no window, no sliding rope base) are the ones llama.cpp read, and their logits are
    its (a layer read as sliding or not, with rope or not, against llama.cpp's reading, moves
    them by far more than LOGITS_ATOL)."""
    rec = LLAMA_CPP_REF["smallthinker-patterns"][pattern]
    path = write_tiny_smallthinker(tmp_path / f"{pattern}.gguf", **PATTERNS[pattern])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["file_sha256"]
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        logits = eng.forward_logits(rec["ids"])
    want = np.load(FIXTURES / "llama_cpp_reference_logits.npz")[f"smallthinker-{pattern}"]
    assert float(np.abs(logits - want).max()) < LOGITS_ATOL


def _routes(eng, ids: list[int]) -> list[tuple[int, np.ndarray]]:
    """Every layer's router input (the layer's input) for ids as a prompt, through the model's
    FFN (its router_in argument)."""
    seen, ffn = [], eng.model.ffn

    def watch(i, x, before, decode=None, router_in=None):
        seen.append((i, router_in.copy()))
        return ffn(i, x, before, decode=decode, router_in=router_in)

    eng.model.ffn = watch
    try:
        eng.forward_logits(ids)
    finally:
        eng.model.ffn = ffn
    return seen


@pytest.mark.parametrize("gating", GATINGS)
def test_the_reference_routes_with_a_margin(models, gating, no_leaks):
    """Between every token's k-th and (k+1)-th router logit (sigmoid and softmax keep their
    order) there is a gap far above float differences (1e-6): no near-tie decides a route."""
    with Engine(models[gating], EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        seen = _routes(eng, PROMPT + REC[gating]["greedy"])
        assert [i for i, _ in seen] == list(range(N_LAYERS))
        gaps = []
        for i, rows in seen:
            w = eng.store.matrix(f"blk.{i}.ffn_gate_inp.weight").astype(np.float64)
            logits = np.sort(rows.astype(np.float64) @ w.T, axis=1)
            gaps.append(float((logits[:, -N_USED] - logits[:, -N_USED - 1]).min()))
    assert min(gaps) > 1e-3


@pytest.mark.parametrize("share,path", [(None, "auto"), (None, "split"), (None, "lockstep"), (0.0, "auto")],
                         ids=["coordinator+worker", "split-attention", "lockstep", "worker-alone"])
@pytest.mark.parametrize("gating", GATINGS)
def test_greedy_and_logits_match_llama_cpp(models, gating, share, path, no_leaks):
    """Each process computes its range of every chosen expert's neurons (32 / 32 with a worker),
    routing each token itself from the layer's input (a posted step carries it after the FFN's;
    a lockstep part copies its own); prompts group their tokens by expert. The decoded tokens
    take the path asked; the prompt and the logits' sequence the per-layer steps."""
    opts = EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=False, decode_path=path, kv_caches=2,
                         coordinator_share=share, adaptive_spin=False if path == "lockstep" else None)
    want = REC[gating]["greedy"]
    with Engine(models[gating], opts) as eng:
        owned = [sum(len(n) for n in s.neurons) for s in eng.plan.shards]
        assert sum(owned) == N_LAYERS * N_FF_EXPERT and sum(1 for n in owned if n) == (1 if share == 0.0 else 2)
        assert all(step is not None for step in eng.model.native)  # NoPE layers too: native attention
        assert eng.model.decode_plan.path.value == {"auto": eng.model.decode_plan.path.value, "split": "split attention",
                                                    "lockstep": "lockstep"}[path]
        got = list(eng.generate(PROMPT, len(want), SamplingParams(temperature=0.0), stop_at_eos=False))
        assert got == want
        assert len(eng.ffn.stats.lockstep_us) == (len(want) - 1 if path == "lockstep" else 0)
        logits = eng.forward_logits(PROMPT + want)
    assert float(np.abs(logits - llama_cpp_logits(gating)).max()) < LOGITS_ATOL


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_a_continuous_batch_decodes_each_sequence_as_alone_bit_for_bit(models, fast, no_leaks):
    """Sequences decoded together route each row from its own layer input and share each chosen
    expert's rows; every row's logits equal its sequence's decoded alone, bit for bit."""
    prompts = [PROMPT, [5, 6, 7, 8, 9], [200, 3]]
    opts = EngineOptions(cpu_workers=1, threads=2, fast=fast, kv_caches=2 * len(prompts) + 1)
    with Engine(models["sigmoid"], opts) as eng:
        assert_batch_is_alone(eng.model, prompts)


def test_fast_arithmetic_decodes_close_to_exact(models, no_leaks):
    """Fast mode (8-bit activations) on the F32 file: logits close to llama.cpp's exact ones."""
    want = llama_cpp_logits("sigmoid")
    with Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2, fast=True)) as eng:
        logits = eng.forward_logits(PROMPT + REC["sigmoid"]["greedy"])
    assert float(np.abs(logits - want).max()) < 0.05 * float(np.abs(want).max())


@pytest.mark.parametrize("gating", GATINGS)
def test_the_routing_kernel_gates_as_llama_cpp(models, gating, isa):
    """moe_route with the architecture's gating at every level: sigmoid (or softmax) of the
    router's logits, the top k by probability, their weights renormalized to sum 1."""
    store = TensorStore(models[gating], open_gguf(models[gating]))
    router = FileMatrix(store.info("blk.1.ffn_gate_inp.weight"))
    w = store.matrix("blk.1.ffn_gate_inp.weight").astype(np.float64)
    x = np.random.default_rng(1).standard_normal((6, w.shape[1])).astype(np.float32) * 0.35
    ids, weights = route(router, x, N_USED, True, gating=gating)
    logits = x.astype(np.float64) @ w.T
    if gating == "sigmoid":
        probs = 1 / (1 + np.exp(-logits))
    else:
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
    top = np.argsort(-probs, axis=1)[:, :N_USED]
    np.testing.assert_array_equal(ids, top)
    chosen = np.take_along_axis(probs, top, 1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(1, keepdims=True), rtol=1e-5)


def test_a_routed_layer_refuses_to_route_without_the_layer_input(models):
    """smallthinker's router scores the layer's input: the FFN input cannot stand in for it."""
    shard = FfnShard.load(models["sigmoid"], [np.arange(N_FF_EXPERT)] * N_LAYERS, weights="gguf")
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="layer's input"):
        shard.layers[0].step(x, "relu", None, None)
    y, _ = shard.layers[0].step(x, "relu", None, None, router_x=x * 0.5)
    assert y.shape == x.shape


@pytest.mark.parametrize("fields,word", [
    ({"expert_gating_func": None}, "smallthinker.expert_gating_func is missing"),
    ({"expert_gating_func": 3}, "smallthinker.expert_gating_func = 3: must be in 1..2 (1 softmax, 2 sigmoid)"),
    ({"expert_gating_func": 0}, "smallthinker.expert_gating_func = 0"),
    ({"expert_feed_forward_length": None}, "smallthinker.expert_feed_forward_length is missing"),
    ({"expert_feed_forward_length": 32}, "blk.0.ffn_gate_exps.weight has shape [64, 64, 8], expected [64, 32, 8]"),
    ({"attention.sliding_window_pattern": (-1, gguf.GGUFValueType.INT32)},
     "smallthinker.attention.sliding_window_pattern = -1: must be in 0..4096"),
    ({"attention.sliding_window_pattern": ("4", gguf.GGUFValueType.STRING)},
     "smallthinker.attention.sliding_window_pattern has type STRING, expected an integer"),
    ({"rope.freq_base_swa": -1.0}, "smallthinker.rope.freq_base_swa = -1.0: must be a finite positive number"),
    ({"expert_used_count": 9}, "smallthinker.expert_used_count = 9")],
    ids=["gating-missing", "gating-3", "gating-0", "expert-ff-missing", "expert-ff-vs-tensors", "pattern-negative",
         "pattern-string", "swa-base", "used-count"])
def test_bad_metadata_is_one_line_naming_the_key(tmp_path, fields, word):
    bad = write_tiny_smallthinker(tmp_path / "bad.gguf", fields=fields)
    with pytest.raises(ModelFileError) as e:
        read_config(bad, open_gguf(bad))
    assert word in str(e.value) and str(bad) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ModelFileError) as e:  # the engine says the same before it starts anything
        Engine(bad, EngineOptions(cpu_workers=1, threads=2), plan_only=True)
    assert word in str(e.value) and "\n" not in str(e.value)


def test_profile_counts_the_routes_of_the_layer_input(models, no_leaks):
    """`sparseinfer profile` routes each token as the engine does: from the layer's input (its
    observer gets it beside the FFN's), which chooses other experts than the FFN input would."""
    from coordinator.tools import profile

    with Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2)) as eng:
        seen = _routes(eng, PROMPT)
        ffn_inputs = []
        eng.ffn.observer = lambda layer, x, *_: ffn_inputs.append(x.copy())
        eng.forward_logits(PROMPT)
        eng.ffn.observer = None
        counted = profile.collect(eng, [PROMPT])
        differs = False
        for (layer, rows), x, freqs in zip(seen, ffn_inputs, counted.freqs):
            router = FileMatrix(eng.store.info(f"blk.{layer}.ffn_gate_inp.weight"))
            count = lambda a: np.bincount(route(router, a, N_USED, True)[0].reshape(-1),  # noqa: E731
                                          minlength=N_EXPERTS) / len(PROMPT)
            np.testing.assert_allclose(freqs, count(rows))
            differs |= not np.allclose(freqs, count(x))
    assert differs  # routing the FFN's input would count other experts


def test_calibrate_routes_the_layer_input(models, no_leaks):
    """`sparseinfer calibrate`'s per-expert CATS levels are over the tokens each expert is chosen
    for, routed from the layer's input: the median of |relu(gate_e x)| over those tokens' FFN
    inputs x, for every expert chosen by at least 16 tokens (fewer: the layer's level)."""
    from coordinator.tools import calibrate

    rng = np.random.default_rng(0)
    chunks = [[int(t) for t in rng.integers(3, 350, 16)] for _ in range(4)]
    with Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2)) as eng:
        table = calibrate.calibrate(eng, chunks, levels=(0.5,))
        seen = [_routes(eng, c) for c in chunks]  # (layer, layer inputs) per chunk and layer
        ffn_in = {i: [] for i in range(N_LAYERS)}
        eng.ffn.observer = lambda layer, x, *_: ffn_in[layer].append(x.copy())
        for c in chunks:
            eng.forward_logits(c)
        eng.ffn.observer = None
        store = eng.store
        checked = differs = 0
        for layer in range(N_LAYERS):
            router = FileMatrix(store.info(f"blk.{layer}.ffn_gate_inp.weight"))
            xs = np.concatenate(ffn_in[layer])
            ids = route(router, np.concatenate([s[layer][1] for s in seen]), N_USED, True)[0]
            wrong = route(router, xs, N_USED, True)[0]
            gates = store.matrix(f"blk.{layer}.ffn_gate_exps.weight")
            (levels,) = table["expert_levels"].values()
            for e in range(N_EXPERTS):
                rows = np.flatnonzero((ids == e).any(axis=1))
                differs += not np.array_equal(rows, np.flatnonzero((wrong == e).any(axis=1)))
                if len(rows) >= calibrate.MIN_EXPERT_ROWS:
                    mags = np.maximum(xs[rows].astype(np.float64) @ gates[e].T.astype(np.float64), 0)
                    assert levels[layer][e] == pytest.approx(np.quantile(mags, 0.5), rel=1e-4, abs=1e-6)
                    checked += 1
    assert checked >= N_LAYERS and differs  # routing the FFN's input would pick other tokens


def test_torch_attention_keeps_the_nope_layers_and_the_router_input(models, no_leaks):
    """A prompt the quality tools watch (attn_observer) takes torch's attention on the
    coordinator (coordinator/model/torch_layers.py): its NoPE layers' identity tables and the
    router's copy of the layer input (taken before attention returns a new h) give llama.cpp's
    logits there too."""
    seen = []
    with Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        eng.model.attn_observer = lambda layer, x, out: seen.append(layer)
        logits = eng.forward_logits(PROMPT + REC["sigmoid"]["greedy"])
    assert seen == list(range(N_LAYERS))  # the torch path ran, once per layer
    assert float(np.abs(logits - llama_cpp_logits("sigmoid")).max()) < LOGITS_ATOL


def test_embeddings_route_from_the_layer_input(models, no_leaks):
    """Transformer.hidden_states (the embeddings endpoint) runs texts' FFNs together, each row
    routed from its own layer input: a text's states are the same alone and beside another, and
    through the head they are llama.cpp's logits of the prompt."""
    with Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2, fast=False, kv_caches=3)) as eng:
        m = eng.model
        alone = m.hidden_states([PROMPT], [m.new_cache()])
        both = m.hidden_states([PROMPT, [9, 8, 7]], [m.new_cache(), m.new_cache()])
        logits = m.head(alone)
    np.testing.assert_array_equal(both[:len(PROMPT)], alone)
    assert float(np.abs(logits - llama_cpp_logits("sigmoid")[:len(PROMPT)]).max()) < LOGITS_ATOL


@pytest.mark.parametrize("path", ["auto", "lockstep"])
def test_relu_experts_skip_their_idle_neurons_exactly(models, tmp_path, path, no_leaks):
    """ReGLU experts: a neuron whose relu(gate x) is 0 adds nothing, so CATS thresholds of 0
    for every expert skip those neurons and decode llama.cpp's tokens and logits, computing
    fewer neurons than the chosen experts hold (SmallThinker's own sparsity)."""
    import json

    from coordinator.tools import calibrate

    level = "0.50"
    with Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2, fast=False)) as eng:
        table = calibrate.calibrate(eng, [PROMPT], levels=(0.5,))
    table["levels"][level] = [0.0] * N_LAYERS
    table["expert_levels"][level] = [[0.0] * N_EXPERTS] * N_LAYERS
    tfile = tmp_path / "zero.thresholds.json"
    tfile.write_text(json.dumps(table))
    want = REC["sigmoid"]["greedy"]
    opts = EngineOptions(cpu_workers=1, threads=2, fast=False, sparsity=0.5, sparse_method="cats",
                         thresholds_file=str(tfile), decode_path=path, kv_caches=2,
                         adaptive_spin=False if path == "lockstep" else None)
    with Engine(models["sigmoid"], opts) as eng:
        assert (eng.pool.buffers.expert_thresholds == 0).all()
        got = list(eng.generate(PROMPT, len(want), SamplingParams(temperature=0.0), stop_at_eos=False))
        eng.reset()
        eng.model.forward(PROMPT + want[:-1])  # a prompt: dense
        eng.ffn.stats.clear_counts()
        logits = eng.model.forward(want[-1:])  # a decoded token: its experts' active neurons only
        computed = sum(eng.ffn.stats.active.values())
    assert got == want
    assert float(np.abs(logits[-1] - llama_cpp_logits("sigmoid")[-1]).max()) < LOGITS_ATOL
    assert 0 < computed < 0.8 * N_LAYERS * N_USED * N_FF_EXPERT  # measured 324 of 640


def test_bench_file_decodes_as_llama_cpp_does(tmp_path, smollm2_path, no_leaks):
    """scripts/make_bench_model.py --arch smallthinker (Q8_0, sigmoid routing, a window in the
    file: llama.cpp's NoPE and sliding layers) writes a file the engine reads as llama.cpp does
    and decodes, in fast mode (8-bit activations, as llama.cpp's Q8_0 products), to the greedy
    tokens llama.cpp picked on it, recorded by scripts/make_llamacpp_reference.py."""
    from scripts.make_llamacpp_reference import SMALLTHINKER_BENCH_ARGS
    from tests.conftest import run_make_bench_model

    rec = LLAMA_CPP_REF["smallthinker-bench"]
    path = tmp_path / "smallthinker.gguf"
    run_make_bench_model([*SMALLTHINKER_BENCH_ARGS, "--tokenizer-from", str(smollm2_path), "-o", str(path)])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["file_sha256"]
    cfg = read_config(path, open_gguf(path))
    assert cfg.expert_gating == "sigmoid" and cfg.router_reads_layer_input and cfg.activation == "relu"
    assert [cfg.layer_has_rope(i) for i in range(5)] == [False, True, True, True, False]
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, fast=True)) as eng:
        assert all(s is not None for s in eng.model.native)
        got = list(eng.generate(rec["prompt"], len(rec["greedy"]), stop_at_eos=False))
    assert got == rec["greedy"]


def test_a_one_token_exchange_is_refused_in_one_line(models, no_leaks):
    """A posted step carries the router's input after the FFN's, so an exchange needs room for
    two rows a token: --max-batch 1 is refused before anything starts."""
    with pytest.raises(ValueError) as e:
        Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2, max_batch=1), plan_only=True)
    assert "--max-batch 1" in str(e.value) and "layer's input" in str(e.value) and "\n" not in str(e.value)
    # 3 rows: a prompt goes one token an exchange, and still decodes llama.cpp's tokens
    want = REC["sigmoid"]["greedy"]
    with Engine(models["sigmoid"], EngineOptions(cpu_workers=1, threads=2, fast=False, max_batch=3)) as eng:
        assert list(eng.generate(PROMPT, len(want), SamplingParams(temperature=0.0), stop_at_eos=False)) == want


def test_the_coordinator_decodes_without_importing_torch(models):
    """The NoPE layers' identity tables, the routers' copies of the layer input and the ReGLU
    experts are all native or numpy: a coordinator decoding smallthinker never imports torch."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.fixtures.child_env import repo_env

    code = ("import sys\nfrom coordinator.runtime.engine import Engine, EngineOptions\n"
            f"with Engine({str(models['sigmoid'])!r}, EngineOptions(cpu_workers=1, threads=2)) as eng:\n"
            f"    print(len(list(eng.generate({PROMPT!r}, 5, stop_at_eos=False))))\n"
            "print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=repo_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["5", "False"]
