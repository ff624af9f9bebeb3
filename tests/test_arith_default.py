"""The default arithmetic is fast (llama.cpp's: activations quantized to 8 bits per block of 32)
wherever an engine starts: EngineOptions and every command that takes the engine options.
`--arith exact` (fast=False) stays for token-for-token comparisons with transformers (the
reference tests ask for it explicitly). Weight formats other than gguf ignore the setting, so
the default never refuses them: they compute exactly what they compute with exact."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator import cli
from coordinator.cli.engine_args import open_engine
from coordinator.runtime.engine import Engine, EngineOptions

ENGINE_COMMANDS = ["generate", "serve", "chat", "bench", "perplexity", "calibrate", "profile", "train-predictor"]


def test_engine_options_default_to_fast_gguf():
    assert EngineOptions().fast is True
    assert EngineOptions().weights == "gguf"


@pytest.mark.parametrize("name", ENGINE_COMMANDS)
def test_every_engine_command_defaults_to_fast(name):
    arith = next(p for p in cli.main.commands[name].params if p.name == "arith")
    assert arith.default == "fast" and set(arith.type.choices) == {"exact", "fast"}


class _Opened(Exception):
    pass


@pytest.mark.parametrize("args,fast,weights", [
    ([], True, "gguf"),
    (["--arith", "exact"], False, "gguf"),
    (["--arith", "fast"], True, "gguf"),
    (["--weights", "f32"], True, "f32"),  # fast is ignored there, not refused
    (["--weights", "int8", "--arith", "exact"], False, "int8"),
], ids=["default", "exact", "fast", "f32", "int8-exact"])
def test_the_cli_passes_its_arith_to_the_engine(monkeypatch, args, fast, weights):
    seen = []

    def fake_engine(path, opts):
        seen.append(opts)
        raise _Opened

    monkeypatch.setattr("coordinator.runtime.engine.Engine", fake_engine)
    ctx = cli.main.commands["generate"].make_context("generate", ["-p", "hi", *args])
    with ctx, pytest.raises(_Opened):
        open_engine("m.gguf", None, None, None, 64, "ipc")
    assert len(seen) == 1 and seen[0].fast is fast and seen[0].weights == weights


def _logits(path, **kw) -> np.ndarray:
    ids = [5, 17, 33, 80, 120, 7, 9]
    with Engine(path, EngineOptions(cpu_workers=1, threads=2, **kw)) as eng:
        prompt = eng.forward_logits(ids[:4])
        eng.reset()
        steps = np.stack([eng.model.forward([t])[-1] for t in ids])
    return np.concatenate([prompt, steps])


@pytest.mark.parametrize("weights", ["f32", "int8", "f16"])
def test_other_weight_formats_ignore_the_default(tiny_model_factory, weights, no_leaks):
    path = tiny_model_factory(tensor_type="Q4_0")
    np.testing.assert_array_equal(_logits(path, weights=weights), _logits(path, weights=weights, fast=False))


def test_the_default_computes_fast_on_the_files_blocks(tiny_model_factory, no_leaks):
    """gguf by default: the 8-bit activations are really applied (logits move, a little)."""
    path = tiny_model_factory(tensor_type="Q4_0")
    default, exact = _logits(path), _logits(path, fast=False)
    scale = np.abs(exact).max()
    assert 2e-5 * scale < np.abs(default - exact).max() < 5e-2 * scale
