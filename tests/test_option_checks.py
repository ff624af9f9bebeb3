"""One set of rules for the engine's options (coordinator/runtime/engine_options.py): the Python API
refuses what the command line refuses, before the model is read or fetched, in one line with
the same words, naming the keyword where the command line names its option; the engine itself
refuses the same values; the command line still prints its one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import HANG_S, REPO

CORES = len(os.sched_getaffinity(0))
NOWHERE = "/nonexistent/model.gguf"  # a value that got past the checks would fail on this file instead

# (the Python keyword and value, the command line's arguments, the message after the option's name)
REFUSED = [
    (dict(threads=CORES + 1), ["-t", str(CORES + 1)],
     f"{CORES + 1}: this machine has {CORES} usable cores: choose 1..{CORES}"),
    (dict(threads=0), ["-t", "0"], f"0: this machine has {CORES} usable cores: choose 1..{CORES}"),
    (dict(cpu_workers=51), ["--cpu-workers", "51"],
     f"51: at most one worker per usable core ({CORES} here): choose 1..{CORES}"),
    (dict(ctx=-5), ["--ctx", "-5"], "-5: the context must hold at least one token"),
    (dict(sparsity=1.5), ["--sparsity", "1.5"], "1.5: choose a fraction in [0, 1)"),
    (dict(sparsity=-0.1), ["--sparsity", "-0.1"], "-0.1: choose a fraction in [0, 1)"),
    (dict(gpu_share=1.5), ["--gpu-share", "1.5"], "1.5: choose 0.0..1.0"),
    (dict(vram_budget_gb=-1.0), ["--vram-budget", "-1"], "-1.0: a budget cannot be negative"),
]
PYTHON_NAME = {"-t": "threads", "--cpu-workers": "cpu_workers", "--ctx": "ctx", "--sparsity": "sparsity",
               "--gpu-share": "gpu_share", "--vram-budget": "vram_budget_gb"}
CLI_NAME = {"-t": "-t/--threads"}


def _refused_by_llm(**kw) -> str:
    import sparseinfer

    with pytest.raises(ValueError) as e:
        sparseinfer.LLM(NOWHERE, **kw)
    return str(e.value)


@pytest.mark.parametrize("kw,args,why", REFUSED, ids=[" ".join(a) for _, a, _ in REFUSED])
def test_the_python_api_refuses_with_the_clis_words(kw, args, why):
    assert _refused_by_llm(**kw) == f"{PYTHON_NAME[args[0]]} {why}"


@pytest.mark.parametrize("kw,msg", [
    (dict(weights="fp8"), "weights 'fp8': unknown weight format: choose one of f32, int8, f16, gguf"),
    (dict(transport="udp"), "transport 'udp': choose one of ipc, tcp"),
    (dict(sparse_method="teal"), "sparse_method 'teal': choose one of input, cats"),
    (dict(threads="2"), "threads '2': choose a whole number"),
    (dict(ctx=None), "ctx None: give a value"),
    (dict(fast=1), "fast 1: choose True or False"),
    (dict(coordinator_share=1.5), "coordinator share must be within [0, 1), got 1.5"),  # the CLI's words too
], ids=["weights", "transport", "sparse-method", "threads-text", "ctx-none", "fast-int", "coordinator-share"])
def test_the_python_api_refuses_other_values_in_one_line(kw, msg):
    assert _refused_by_llm(**kw) == msg


def test_a_refusal_comes_before_the_default_model_is_fetched(monkeypatch):
    import sparseinfer

    def no_pull(*a, **kw):
        raise AssertionError("the model was fetched before the options were checked")

    monkeypatch.setattr("coordinator.runtime.model_fetch.pull", no_pull)
    with pytest.raises(ValueError, match=r"^threads 0: "):
        sparseinfer.LLM(threads=0)
    with pytest.raises(ValueError, match=r"^sparsity 2: "):
        sparseinfer.LLM(sparsity=2)


def test_the_engine_refuses_the_same_values():
    from coordinator.runtime.engine import Engine, EngineOptions

    with pytest.raises(ValueError, match=rf"^threads {CORES + 1}: this machine has {CORES} usable cores"):
        Engine(NOWHERE, EngineOptions(threads=CORES + 1))
    with pytest.raises(ValueError, match=r"^ctx 0: the context must hold at least one token$"):
        Engine(NOWHERE, EngineOptions(ctx=0))


def test_good_values_pass():
    from coordinator.runtime.engine_options import EngineOptions

    EngineOptions().validate()
    EngineOptions(threads=CORES, cpu_workers=1, ctx=1, gpu_share=0.0, sparsity=0.0, vram_budget_gb=0.0,
                  coordinator_share=0.0, gpu_device="cuda:1", predictor="none", interleave=False).validate()


def _cli(args: list) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=HANG_S)


@pytest.mark.parametrize("kw,args,why", REFUSED, ids=[" ".join(a) for _, a, _ in REFUSED])
def test_the_cli_still_prints_its_one_line_error(tiny_model, kw, args, why):
    r = _cli(["generate", "-m", str(tiny_model), "-p", "hi", *args])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert lines == [f"error: {CLI_NAME.get(args[0], args[0])} {why}"], r.stderr


def test_info_refuses_a_context_of_no_tokens(tiny_model):
    r = _cli(["info", "-m", str(tiny_model), "--ctx", "0"])
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: --ctx 0: the context must hold at least one token"], r.stderr
