"""SmolLM2-135M-Instruct requantized to Q3_K, Q2_K and IQ4_XS (tests/fixtures/lowbit_smollm2.py:
ffn_down in the type, the other matrices IQ4_NL, as llama.cpp's fallback) against transformers'
GGUF loader: exact mode's greedy tokens are transformers' (scripts/make_reference.py --type
wrote them, from the same bytes: the file's sha256 is checked first).

A 135M model in 2-3 bits is close to a coin toss between tokens at some steps: where
transformers' own margin between its two best logits falls under MARGIN, a float32 sum in
another order may pick the other one, and from there the texts part. The tokens must agree up
to the first such step, and that step must come late enough to mean something (MIN_STEPS)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.sampling import SamplingParams
from tests.fixtures.lowbit_smollm2 import LOW_BIT_TYPES, sha256, write_lowbit_copy

FIXTURES = Path(__file__).parent / "fixtures"
MARGIN = 1e-3  # logits differ by ~1e-5 between summation orders (tests/test_smollm2_reference.py)
MIN_STEPS = 16

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module", params=LOW_BIT_TYPES)
def lowbit(request, smollm2_path, tmp_path_factory):
    ref = json.loads((FIXTURES / f"smollm2_{request.param.lower()}_reference.json").read_text())
    path = write_lowbit_copy(smollm2_path, tmp_path_factory.mktemp("lowbit") / ref["model_file"], request.param)
    assert sha256(path) == ref["model_sha256"], "the requantized file differs from the one transformers read"
    with Engine(path, EngineOptions(threads=2, fast=False)) as eng:  # exact: transformers' arithmetic
        yield eng, ref


def test_greedy_tokens_match_transformers(lowbit):
    eng, ref = lowbit
    for case in ref["prompts"]:
        want, margins = case["generated_ids"], case["margins"]
        assert eng.tokenizer.encode(case["prompt_text"]) == case["prompt_ids"]
        got = list(eng.generate(case["prompt_ids"], len(want), SamplingParams(0.0), stop_at_eos=False))
        close = next((i for i, m in enumerate(margins) if m < MARGIN), len(want))
        assert close >= MIN_STEPS, f"{case['name']}: transformers' margin is {margins[close]:.1e} at step {close}"
        assert got[:close] == want[:close], (
            f"{case['name']}: first difference at step "
            f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)} (margins from step {close} under {MARGIN})")
