"""SmolLM2-135M-Instruct Q4_1 against transformers' GGUF loader (an oracle nobody here wrote).

The fixture comes from scripts/make_reference.py: greedy token ids of 64 new tokens for several
prompts and full-vocabulary logits at two steps, computed by transformers in float32 on the
dequantized weights. Tolerance for logits: our attention and FFN run the same float32 math in a
different summation order (the FFN is split across worker processes), which moves logits by
~4e-5 (measured); we allow 5e-4 absolute (logits here range over about +-30).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.sampling import SamplingParams
from sparsecore.kernels import MAX_SMALL_BATCH

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "smollm2_reference.json").read_text())
LOGITS_ATOL = 5e-4

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with Engine(smollm2_path, EngineOptions(threads=2, fast=False)) as eng:  # exact: transformers' arithmetic
        yield eng


@pytest.mark.parametrize("case", REF["prompts"], ids=[p["name"] for p in REF["prompts"]])
def test_greedy_tokens_match_transformers(engine, case):
    assert engine.tokenizer.encode(case["prompt_text"]) == case["prompt_ids"]
    got = list(engine.generate(case["prompt_ids"], len(case["generated_ids"]), SamplingParams(0.0),
                               stop_at_eos=False))
    assert got == case["generated_ids"], (
        f"first difference at step {next(i for i, (a, b) in enumerate(zip(got, case['generated_ids'])) if a != b)}")


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "per-layer"])
def test_greedy_tokens_match_transformers_with_attention_split_across_processes(smollm2_path, lockstep):
    """Decoded tokens' attention heads split between the coordinator and the worker (at every
    context length: SmolLM2's short prompts alone would not pay for the extra exchange), and the
    prompt's too (always split: chunks of up to 16 tokens per exchange). Decoded tokens go
    through every layer in lockstep (each process sums the shares itself), or layer by layer
    through posted steps."""
    # decode_path: that path at every size; adaptive_spin=False: keep spinning on a busy machine,
    # every step in lockstep
    opts = EngineOptions(threads=2, cpu_workers=1, fast=False, decode_path="lockstep" if lockstep else "split",
                         adaptive_spin=False if lockstep else None)
    with Engine(smollm2_path, opts) as eng:
        assert eng.model.split_attn is not None
        assert (eng.model.lockstep is not None) == lockstep
        st = eng.ffn.stats
        for case in REF["prompts"]:
            calls, steps = len(st.attn_us), len(st.lockstep_us)
            got = list(eng.generate(case["prompt_ids"], len(case["generated_ids"]), SamplingParams(0.0),
                                    stop_at_eos=False))
            assert got == case["generated_ids"], case["name"]
            chunks = -(-len(case["prompt_ids"]) // MAX_SMALL_BATCH) if len(case["prompt_ids"]) > 1 else 1
            decoded = len(got) - 1
            if lockstep:
                assert len(st.lockstep_us) - steps == decoded
                assert len(st.attn_us) - calls == chunks * eng.cfg.n_layers
            else:
                assert len(st.lockstep_us) == steps
                assert len(st.attn_us) - calls == (decoded + chunks) * eng.cfg.n_layers


def test_logits_match_transformers(engine):
    arrays = np.load(FIXTURES / "smollm2_reference_logits.npz", allow_pickle=False)
    steps = REF["logit_steps"]
    worst = 0.0
    for i, case in enumerate(REF["prompts"]):
        seq = case["prompt_ids"] + case["generated_ids"]
        logits = engine.forward_logits(seq[: len(case["prompt_ids"]) + max(steps)])
        for step in steps:
            want = arrays[f"p{i}_step{step}"].astype(np.float32)
            got = logits[len(case["prompt_ids"]) - 1 + step]
            worst = max(worst, float(np.abs(got - want).max()))
            assert int(np.argmax(got)) == int(np.argmax(want))
    assert worst < LOGITS_ATOL, f"max |logit difference| {worst:.2e} exceeds {LOGITS_ATOL}"


def test_chat_prompt_uses_the_gguf_template(engine):
    chat = next((p for p in REF["prompts"] if p["kind"] == "chat"), None)
    if chat is None:
        pytest.skip("fixture has no chat prompt")
    assert engine.chat_prompt(chat["text"]) == chat["prompt_text"]
