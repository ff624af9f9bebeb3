"""coordinator/runtime/decode_plan.py: the one decision of which path a decoded token takes (lockstep,
split attention, native, torch), why, and with which thresholds; a forced path is taken at every
size or refused at start with the reason."""
from __future__ import annotations

import pytest

from coordinator.runtime.decode_plan import (MIN_LOCKSTEP_BYTES, MIN_SPLIT_BYTES, MIN_SPLIT_BYTES_BATCH, DecodePath,
                                     plan_decode)
from coordinator.runtime.engine import Engine, EngineOptions

HEADS = {0: (0, 1), -1: (1, 2)}


def test_auto_takes_the_best_path_the_processes_support():
    best = plan_decode("auto", HEADS, "", True, "", "", (0,))
    assert best.path is DecodePath.LOCKSTEP and best.split and best.lockstep_slots == (0,)
    assert (best.split_min_bytes, best.lockstep_min_bytes) == ((MIN_SPLIT_BYTES, MIN_SPLIT_BYTES_BATCH),
                                                               MIN_LOCKSTEP_BYTES)
    split = plan_decode("auto", HEADS, "", True, "", "a worker cannot take part")
    assert split.path is DecodePath.SPLIT and "a worker cannot take part" in split.reason
    native = plan_decode("auto", {}, "no CPU worker computes neurons", True, "", "attention is not split")
    assert native.path is DecodePath.NATIVE and not native.split and "no CPU worker" in native.reason
    torch = plan_decode("auto", {}, "weights f32", False, "weights f32: the native step reads the file's blocks",
                        "attention is not split")
    assert torch.path is DecodePath.TORCH
    # heads but a layer without a native step: attention stays on the coordinator
    assert plan_decode("auto", HEADS, "", False, "a layer's shape", "").path is DecodePath.TORCH


def test_a_forced_path_is_taken_at_every_size_or_refused_with_the_reason():
    locked = plan_decode("lockstep", HEADS, "", True, "", "", (0,))
    assert locked.path is DecodePath.LOCKSTEP and locked.forced
    assert (locked.split_min_bytes, locked.lockstep_min_bytes) == ((0, 0), 0)
    split = plan_decode("split", HEADS, "", True, "", "")  # lockstep possible, but split asked for
    assert split.path is DecodePath.SPLIT and split.split_min_bytes == (0, 0)
    with pytest.raises(ValueError, match="a worker cannot take part"):
        plan_decode("lockstep", HEADS, "", True, "", "a worker cannot take part")
    with pytest.raises(ValueError, match="split_attention"):
        plan_decode("split", {}, "attention split turned off (split_attention)", True, "", "")
    with pytest.raises(ValueError, match="one of auto"):
        plan_decode("fastest", HEADS, "", True, "", "")


def test_the_plan_says_in_one_line_which_path_why_and_the_shares():
    line = plan_decode("auto", HEADS, "", True, "", "", (0,)).describe()
    assert line.startswith("lockstep: ") and "worker slot 0 0-1, coordinator 1-2" in line
    assert "\n" not in line


def test_the_engine_builds_the_model_with_its_plan(tiny_model_factory, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=4, n_heads=4, n_kv_heads=2)
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, fast=False)) as eng:
        plan = eng.decode_plan
        assert plan is eng.model.decode_plan and plan.path is DecodePath.LOCKSTEP and not plan.forced
        assert eng.model.lockstep is not None and eng.model.split_attn.min_bytes == plan.split_min_bytes
        assert eng.model.lockstep.min_bytes == plan.lockstep_min_bytes
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, fast=False, split_attention=False)) as eng:
        assert eng.decode_plan.path is DecodePath.NATIVE and eng.model.split_attn is None
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, weights="f32")) as eng:
        assert eng.decode_plan.path is DecodePath.TORCH and "f32" in eng.decode_plan.reason
    with pytest.raises(ValueError, match="decode path lockstep: .*split_attention"):
        Engine(path, EngineOptions(threads=2, cpu_workers=1, split_attention=False, decode_path="lockstep"))


def test_adaptive_spin_false_keeps_the_coordinator_spinning(tiny_model_factory, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0", seed=4, n_heads=4, n_kv_heads=2)
    with Engine(path, EngineOptions(threads=2, cpu_workers=1, adaptive_spin=False)) as eng:
        assert eng.pool.bell.governor.adaptive is False


@pytest.mark.smollm2
def test_which_path_ran_a_token_does_not_change_its_reply(smollm2_path, no_leaks):
    """A lockstep engine's tokens that fall back to the layers (contended cores: the spin
    governor decides by the machine's load) split their attention as lockstep steps do
    (DecodePlan.every_token), so they compute the same floats (tests/test_lockstep.py checks the
    two paths bit for bit): one engine's greedy reply is the same on every run. SmolLM2's drifted
    between runs ("Napoli", "Napa") as the governor switched paths on a busy machine."""
    from coordinator.runtime.sampling import SamplingParams

    assert plan_decode("auto", HEADS, "", True, "", "", (0,)).every_token
    with Engine(smollm2_path, EngineOptions(threads=2)) as eng:
        assert eng.decode_plan.path is DecodePath.LOCKSTEP and eng.decode_plan.every_token
        ids = eng.encode_chat([{"role": "system", "content": "You are brief."},
                               {"role": "user", "content": "What is the capital of Italy?"}])
        replies = {tuple(eng.generate(ids, 32, SamplingParams(0.0))) for _ in range(6)}
    assert len(replies) == 1
