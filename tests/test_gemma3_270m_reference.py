"""Gemma 3 270M Q4_K_M (`sparseinfer pull gemma3-270m`) against transformers' GGUF loader.

The fixture comes from scripts/make_gemma3_reference.py: greedy ids of 32 new tokens for a few
prompts (BOS added as transformers' tokenizer adds it) and the logits of the first
step at a sample of the vocabulary (its top 512 and every 512th id), transformers in
float32 on the dequantized weights. Logits within LOGITS_ATOL absolute.
Skipped when the model has not been pulled.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.runtime.engine import Engine, EngineOptions
from coordinator.runtime.sampling import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "gemma3_270m_reference.json").read_text())
LOGITS_ATOL = 2e-4  # measured: at most 2.4e-5, logits up to about 26


@pytest.fixture(scope="module")
def engine(gemma3_path):
    with Engine(gemma3_path, EngineOptions(threads=2, fast=False)) as eng:  # exact: transformers' arithmetic
        yield eng


@pytest.mark.parametrize("case", REF["prompts"], ids=[p["name"] for p in REF["prompts"]])
def test_greedy_tokens_match_transformers(engine, case):
    assert engine.tokenizer.encode(case["prompt_text"]) == case["prompt_ids"]  # BOS included
    got = list(engine.generate(case["prompt_ids"], len(case["generated_ids"]), SamplingParams(0.0),
                               stop_at_eos=False))
    assert got == case["generated_ids"]


def test_first_step_logits_match_transformers(engine):
    arrays = np.load(FIXTURES / "gemma3_270m_reference_logits.npz")
    worst = 0.0
    for i, case in enumerate(REF["prompts"]):
        got = engine.forward_logits(case["prompt_ids"])[-1]
        ids, want = arrays[f"p{i}_ids"], arrays[f"p{i}_logits"]  # a sample: the top 512, then every 512th id
        assert int(np.argmax(got)) == int(ids[0])
        worst = max(worst, float(np.abs(got[ids] - want).max()))
    assert worst < LOGITS_ATOL, worst
