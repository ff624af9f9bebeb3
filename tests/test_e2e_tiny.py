"""End to end on tiny synthetic models: real coordinator + worker processes vs an oracle.

The oracle (tests/fixtures/reference_llama.py) shares no code with the engine, so agreement checks the
GGUF reading, Q/K handling, RoPE, GQA attention, KV cache, the FFN split across workers and
the summation of their shared-memory slots all at once.
"""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.sampling import SamplingParams
from tests.fixtures.reference_llama import ReferenceLlama

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.mark.parametrize("tensor_type,tied,weights", [
    ("F32", False, "f32"), ("Q8_0", True, "f32"), ("Q4_K", False, "f32"), ("Q6_K", False, "f32"),
    ("F16", False, "f32"), ("Q4_1", False, "f32"), ("BF16", False, "f32"), ("Q5_K", False, "f32"),
    ("Q4_0", False, "f32"),
    # the file's own blocks through the native kernels, exact arithmetic: the same oracle tokens
    ("Q4_0", False, "gguf"), ("Q4_1", False, "gguf"), ("Q8_0", True, "gguf"), ("F16", False, "gguf"),
    ("BF16", False, "gguf"), ("F32", False, "gguf"),
    ("Q4_K", False, "gguf"), ("Q5_K", False, "gguf"), ("Q6_K", False, "gguf"),  # shards cut on 256 neurons
    ("Q5_0", False, "gguf"), ("Q5_1", False, "gguf"), ("IQ4_NL", False, "gguf"), ("IQ4_XS", False, "gguf"),
    ("Q2_K", False, "gguf"), ("Q3_K", False, "gguf"),
])
def test_greedy_and_logits_match_reference(tiny_model_factory, tensor_type, tied, weights, no_leaks):
    path = tiny_model_factory(tensor_type=tensor_type, tied_embeddings=tied)
    ref = ReferenceLlama(path)
    with Engine(path, EngineOptions(cpu_workers=2, threads=2, gpu_share=0.3, weights=weights, fast=False)) as eng:
        ids = eng.tokenizer.encode(PROMPT)
        want = ref.greedy(ids, 12)
        got = list(eng.generate(ids, 12, SamplingParams(temperature=0.0), stop_at_eos=False))
        assert got == want
        seq = ids + got
        logits = eng.forward_logits(seq)
    ref_logits = ref.logits(seq)
    assert logits.shape == ref_logits.shape
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=2e-3 * np.abs(ref_logits).max())


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q8_0", "Q2_K", "Q3_K"])
def test_fast_arithmetic_stays_close_to_the_oracle(tiny_model_factory, tensor_type, no_leaks):
    """8-bit activations (llama.cpp's arithmetic, for one-token steps: prefill batches dequantize
    and run GEMMs) move logits by about 1 % of their range, not more, and really differ from the
    exact ones (the mode is applied)."""
    path = tiny_model_factory(tensor_type=tensor_type)
    ref = ReferenceLlama(path)
    ids = [5, 17, 33, 80, 120, 7, 9]
    want = ref.logits(ids)
    got = {}
    for fast in (False, True):
        with Engine(path, EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=fast)) as eng:
            eng.reset()
            got[fast] = np.stack([eng.model.forward([t])[-1] for t in ids])
    scale = np.abs(want).max()
    assert np.abs(got[False] - want).max() < 2e-3 * scale
    assert 2e-5 * scale < np.abs(got[True] - want).max() < 5e-2 * scale


def test_spinning_and_sleeping_give_the_same_tokens(tiny_model, no_leaks, monkeypatch):
    """One worker and the coordinator on two cores spin on the shared-memory doorbell; forced
    off, both sleep on their wake pipes and ring each other. Both must produce the oracle's
    tokens; the spinning run must really have skipped the wake-ups (all but those after idle
    gaps), and the sleeping one must have woken its worker by pipe."""
    # The spin rule as chosen at start, not adapted to load: on a busy machine the adaptive
    # policy rightly sleeps, and the wake-up count below would measure the neighbours.
    monkeypatch.setenv("SPARSEINFER_SYNC", "static")
    ref = ReferenceLlama(tiny_model)
    ids = [5, 17, 33, 80, 120]
    want = ref.greedy(ids, 16)
    for spin in (True, False):
        with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, spin=spin, fast=False)) as eng:
            assert eng.pool.spin is spin
            got = list(eng.generate(ids, 16, SamplingParams(temperature=0.0), stop_at_eos=False))
            exchanges, wakeups = len(eng.ffn.stats.round_trip_us), eng.pool.bell.wakeups
        assert got == want, f"spin={spin}"
        if spin:
            assert wakeups < exchanges / 4, (wakeups, exchanges)
        else:  # a worker that has not yet marked itself asleep takes the step from the doorbell
            assert wakeups > exchanges * 3 / 4, (wakeups, exchanges)


@pytest.mark.parametrize("share", [0.0, 0.5, 0.9])
def test_coordinator_share_gives_the_oracle_tokens(tiny_model, share, no_leaks):
    """The coordinator computing a share of each layer's neurons itself (between ringing the
    workers and waiting for them), and of the lm_head's rows, changes which process computes
    a neuron or a logit, not the result:
    the oracle's greedy tokens and logits for every share, with the stats accounting for the
    coordinator's rows and neurons (thresholded steps: tests/test_thresholds.py)."""
    ref = ReferenceLlama(tiny_model)
    ids = [5, 17, 33, 80, 120]
    want = ref.greedy(ids, 10)
    # float32 copies: the byte counts below are theirs, and the share is not cut on blocks
    with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, coordinator_share=share, weights="f32")) as eng:
        n_ff, hidden, n_layers = eng.cfg.n_ff, eng.cfg.hidden, eng.cfg.n_layers
        n_local = round(share * n_ff)
        assert eng.pool.own_slot == (1 + 1 if n_local else None)  # after the GPU and CPU workers
        got = list(eng.generate(ids, 10, SamplingParams(temperature=0.0), stop_at_eos=False))
        s = eng.stats()
        # the lm_head's rows are split with the FFN: one head step per generated token
        assert (eng.head.split is not None) == bool(n_local)
        assert len(eng.ffn.stats.head_us) == (10 if n_local else 0)
        assert s["coordinator_ffn_bytes"] == n_layers * n_local * hidden * 12
        assert sum(s["worker_weight_bytes"]) == n_layers * (n_ff - n_local) * hidden * 12
        assert sum(eng.ffn.stats.active.values()) == sum(eng.ffn.stats.tokens.values()) * n_ff  # dense
        logits = eng.forward_logits(ids + got)
    assert got == want
    ref_logits = ref.logits(ids + got)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=2e-3 * np.abs(ref_logits).max())


def test_coordinator_share_is_refused_with_a_vram_budget(tiny_model):
    with pytest.raises(ValueError, match="--coordinator-share"):
        Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, coordinator_share=0.3, vram_budget_gb=0.01))


def test_prefill_in_chunks_equals_one_batch(tiny_model):
    """The FFN exchange splits long prompts into max_batch chunks; the result must not change."""
    ids = list(range(3, 60))
    with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, max_batch=7)) as eng:
        chunked = eng.forward_logits(ids)
    with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, max_batch=256)) as eng:
        whole = eng.forward_logits(ids)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)


def test_decode_with_cache_equals_full_recompute(tiny_model):
    """Token-by-token decoding through the KV cache gives the logits of a full forward pass."""
    ids = [5, 17, 33, 80, 120]
    with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2)) as eng:
        full = eng.forward_logits(ids)
        eng.reset()
        step = [eng.model.forward([t])[-1] for t in ids]
    np.testing.assert_allclose(np.stack(step), full, rtol=1e-4, atol=1e-4)


def test_sampling_is_reproducible_with_seed(tiny_model):
    with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2)) as eng:
        ids = eng.tokenizer.encode(PROMPT)
        sp = lambda seed: SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=seed)
        a = list(eng.generate(ids, 16, sp(1), stop_at_eos=False))
        b = list(eng.generate(ids, 16, sp(1), stop_at_eos=False))
        c = list(eng.generate(ids, 16, sp(2), stop_at_eos=False))
    assert a == b
    assert a != c


def test_context_overflow_is_a_clear_error(tiny_model):
    with Engine(tiny_model, EngineOptions(cpu_workers=1, threads=2, ctx=32)) as eng:
        with pytest.raises(ValueError, match="exceeds the context size 32"):
            list(eng.generate(list(range(3, 30)), 10))


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q8_0", "F16"])
def test_native_attention_step_equals_the_torch_path(tiny_model_factory, tensor_type, no_leaks):
    """The one-call attention block (RMSNorm, Q/K/V, RoPE, KV cache, GQA softmax, output) gives
    the torch path's decode logits, and is really used (the model holds one per layer)."""
    path = tiny_model_factory(tensor_type=tensor_type)
    ids = [5, 17, 33, 80, 120, 7, 9, 44]
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, weights="gguf", fast=False)) as eng:
        m = eng.model
        assert all(step is not None for step in m.native)
        got = []
        for native in (list(m.native), [None] * len(m.native)):
            m.native = native
            eng.reset()
            got.append(np.stack([m.forward([t])[-1] for t in ids]))
    scale = np.abs(got[1]).max()
    np.testing.assert_allclose(got[0], got[1], rtol=0, atol=1e-5 * scale)
