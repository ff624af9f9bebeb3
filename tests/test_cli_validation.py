"""The CLI refuses what it can before the model loads: one line `error: ...` naming the option,
exit 1 (click's own parse errors, such as `-n abc`, keep click's usage code 2, also in one line),
no traceback, and without starting the engine (its model module is never imported, which
happens only after the worker processes are started: that, not a clock, bounds the work a
refusal does). Also: --seed -1 means random, --ctx beyond the model's
trained context is capped with a note, and Ctrl-C works when SIGINT was ignored at start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import HANG_S, REPO, children_of
from tests.fixtures import procs
from tests.fixtures.child_env import repo_env

CORES = len(os.sched_getaffinity(0))
# Runs the CLI as `python -m coordinator` does, then says on stdout whether the model module was
# imported: the engine imports it once its worker processes are started, so "no" means nothing was.
WRAP = ("import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('coordinator', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    print('\\n[engine started: %s]' % ('coordinator.model.transformer' in sys.modules))\n")


def _cli(args: list, timeout: float = HANG_S):
    """The timeout only catches a hang: a refusal takes about 0.5 s."""
    return subprocess.run([sys.executable, "-c", WRAP, *args], capture_output=True, cwd=REPO, env=repo_env(),
                          timeout=timeout)


def _assert_refused(args, needle: str, code: int = 1) -> None:
    r = _cli(args)
    err, out = r.stderr.decode(errors="replace"), r.stdout.decode(errors="replace")
    lines = err.strip().splitlines()
    assert r.returncode == code, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert "[engine started: False]" in out, "the engine started before the option was refused"


BAD_GENERATE = [
    (["-n", "0"], "-n/--max-tokens 0"),
    (["-n", "-5"], "-n/--max-tokens -5"),
    (["-n", "300"], "-n/--max-tokens 300: does not fit the context of 256"),
    (["-n", "250", "--ctx", "100"], "-n/--max-tokens 250: does not fit the context of 100"),
    (["-t", "-2"], "-t/--threads -2"),
    (["-t", "0"], "-t/--threads 0"),
    (["-t", str(CORES + 1)], f"-t/--threads {CORES + 1}: this machine has {CORES} usable cores"),
    (["--cpu-workers", "0"], "--cpu-workers 0"),
    (["--cpu-workers", "51"], f"--cpu-workers 51: at most one worker per usable core ({CORES} here)"),
    (["--ctx", "-5"], "--ctx -5"),
    (["--ctx", "0"], "--ctx 0"),
    (["--seed", "-2"], "--seed -2: choose -1 (random) or a seed >= 0"),
    (["--sparsity", "1.5"], "--sparsity 1.5"),
    (["--gpu-share", "-0.1"], "--gpu-share -0.1"),
    (["--vram-budget", "-1"], "--vram-budget -1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--min-p", "1.5"], "min-p must be in [0, 1]"),
    (["--repeat-penalty", "0"], "repeat penalty must be in (0, 10]"),
    (["--presence-penalty", "3"], "presence penalty must be in [-2, 2]"),
    (["--repeat-last-n", "-1"], "repeat-last-n must be >= 0"),
    (["--quality-budget", "-0.5"], "--quality-budget -0.5"),
]


@pytest.mark.parametrize("args,needle", BAD_GENERATE, ids=[" ".join(a) for a, _ in BAD_GENERATE])
def test_generate_refuses_bad_values_before_loading(tiny_model, args, needle):
    _assert_refused(["generate", "-m", str(tiny_model), "-p", "hello", *args], needle)


def test_a_prompt_that_leaves_no_room_is_refused_before_loading(tiny_model):
    # 40 words: more tokens than the 64 - 40 left; a prompt of few bytes is not tokenized at all
    # before loading (count_prompt_tokens), and the engine then counts it again
    _assert_refused(["generate", "-m", str(tiny_model), "-p", "hello " * 40, "-n", "40", "--ctx", "64"],
                    "+ 40 exceed the context of 64 tokens")


def test_prompt_tokens_are_counted_only_where_they_may_not_fit(tiny_model):
    from coordinator.cli.validation import count_prompt_tokens

    assert count_prompt_tokens(tiny_model, "hello", 3, 64) is None  # 5 bytes + 3 + 3 <= 64: no tokenizer built
    n = count_prompt_tokens(tiny_model, "hello " * 40, 3, 64)
    assert n is not None and 40 <= n <= 240
    assert count_prompt_tokens(tiny_model, "hello", 57, 64) is not None  # 5 + 3 + 57 > 64: counted


def test_empty_prompt_is_refused(tiny_model):
    _assert_refused(["generate", "-m", str(tiny_model), "-p", ""], "-p/--prompt '': empty")


def test_prompt_not_valid_in_the_terminal_encoding_is_refused(tiny_model):
    # bytes that are not UTF-8 reach Python's argv as lone surrogates
    _assert_refused(["generate", "-m", str(tiny_model), "-p", b"caf\xe9 \xff"],
                    "byte 0xe9 at character 3 is not valid in the terminal's encoding")


def test_prompt_longer_than_the_context_is_refused_before_loading(tiny_model):
    _assert_refused(["generate", "-m", str(tiny_model), "-p", "hello world " * 200, "-n", "4"],
                    "-n/--max-tokens 4: the prompt's")


def test_click_parse_errors_are_one_line_with_usage_code(tiny_model):
    _assert_refused(["generate", "-m", str(tiny_model), "-p", "hi", "-n", "abc"], "'abc' is not a valid integer", 2)
    _assert_refused(["generate", "-m", str(tiny_model), "-p", "hi", "--bogus"], "No such option", 2)


OTHER_COMMANDS = [
    (["chat", "-n", "0"], "-n/--max-tokens 0"),
    (["chat", "--cpu-workers", "51"], "--cpu-workers 51"),
    (["chat", "--system", ""], "--system '': empty"),
    (["serve", "--cpu-workers", "51"], "--cpu-workers 51"),
    (["serve", "-t", "0"], "-t/--threads 0"),
    (["serve", "--ctx", "0"], "--ctx 0"),
    (["serve", "--port", "99999"], "99999 is not a port number"),
    (["bench", "-n", "1"], "-n/--n-gen 1"),
    (["bench", "-p", "200", "-n", "100"], "-p 200 + -n 100 + 1: 301 tokens do not fit the model's trained context"),
    (["bench", "-r", "0"], "-r/--reps 0"),
    (["bench", "--cpu-workers", "51"], "--cpu-workers 51"),
    (["calibrate", "--chunks", "0"], "--chunks 0"),
    (["calibrate", "--levels", "0.2,x"], "--levels 0.2,x"),
    (["perplexity", "--chunk-len", "1000"], "--chunk-len 1000: 1000 tokens do not fit"),
    (["perplexity", "-t", "-1"], "-t/--threads -1"),
    (["profile", "--corpus", "/nonexistent/text.txt"], "--corpus /nonexistent/text.txt: no such file"),
    (["train-predictor", "--rank", "0"], "--rank 0"),
    (["train-predictor", "--chunk-len", "1000"], "--chunk-len 1000"),
    (["train-predictor", "-t", str(CORES + 1)], f"-t/--threads {CORES + 1}"),
    (["info", "-t", str(CORES + 1)], f"-t/--threads {CORES + 1}"),
]


@pytest.mark.parametrize("args,needle", OTHER_COMMANDS, ids=[" ".join(a) for a, _ in OTHER_COMMANDS])
def test_every_engine_command_refuses_before_loading(tiny_model, args, needle):
    _assert_refused([args[0], "-m", str(tiny_model), *args[1:]], needle)


@pytest.mark.parametrize("args,needle", [
    (["-p", ""], "-p/--prompt '': empty"),
    (["-p", "hi", "-n", "0"], "-n/--max-tokens 0"),
    (["-p", "hi", "--seed", "-3"], "--seed -3"),
], ids=["empty", "n0", "seed"])
def test_prompt_client_refuses_before_connecting(args, needle):
    _assert_refused(["prompt", "--url", "http://127.0.0.1:9", *args], needle)


def test_ctx_beyond_the_trained_context_is_capped_with_a_note(tiny_model):
    r = _cli(["generate", "-m", str(tiny_model), "-p", "hello", "-n", "3", "--ctx", "100000", "--no-stats"],
                timeout=180)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "note: --ctx 100000 capped at the model's trained context, 256 tokens" in err, err


def test_seed_minus_one_means_random(tiny_model):
    r = _cli(["generate", "-m", str(tiny_model), "-p", "hello", "-n", "3", "--temperature", "0.8",
                 "--seed", "-1", "--no-stats"], timeout=180)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().startswith("hello")


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_works_when_started_with_sigint_ignored(tiny_model_factory):
    """A background job inherits SIGINT ignored; the CLI restores it at start, so Ctrl-C (here a
    SIGINT once the model has loaded and tokens flow) still stops the run and its workers."""
    model = tiny_model_factory(tensor_type="F32", ctx=16384)  # room for a run long enough to interrupt
    env = repo_env()
    env["PYTHONUNBUFFERED"] = "1"  # see the prompt's echo as soon as the engine has loaded
    p = subprocess.Popen([sys.executable, "-m", "coordinator", "generate", "-m", str(model), "-p", "hello",
                          "-n", "16000", "--ignore-eos", "--ctx", "16384"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=REPO, env=env, preexec_fn=_ignore_sigint)
    try:
        assert p.stdout.read(5) == b"hello"  # loaded and generating
        workers = children_of(p.pid)
        assert workers, "no worker process to check"
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
        err = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    deadline = time.monotonic() + HANG_S  # they are gone at once; this only catches one that stays
    while any(procs.exists(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if procs.exists(w)], "a worker outlived the interrupted run"


def test_a_ctrl_c_a_library_rewrapped_still_ends_as_an_interrupt():
    """A Ctrl-C that lands where a library re-raises it as another error (a class body's
    dataclass field: Python 3.11's __set_name__ wraps it in a RuntimeError, seen while a start
    imported coordinator/runtime/sparse_ffn.py) ends as one: one line, status 130, no traceback."""
    code = ("import os, signal, time\n"
            "from coordinator.cli.app import main\n"
            "@main.command()\n"
            "def wrapped():\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        time.sleep(30)\n"
            "    except KeyboardInterrupt as e:\n"
            "        raise RuntimeError('a library wrapped the interrupt') from e\n"
            "main(['wrapped'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                       env=repo_env())
    assert r.returncode == 128 + signal.SIGINT, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip() == "interrupted"
