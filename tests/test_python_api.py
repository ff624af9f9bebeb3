"""docs/PYTHON_API.md's examples, run as they are written, and what they promise about the
processes and memory they leave."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, children_of
from tests.fixtures.child_env import repo_env

PAGE = REPO / "docs" / "PYTHON_API.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


@pytest.mark.smollm2
@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i + 1}" for i in range(len(EXAMPLES))])
def test_the_page_examples_run(code, smollm2_path, no_leaks):
    exec(compile(code, str(PAGE), "exec"), {})


def test_every_python_block_of_the_page_is_an_example_that_compiles():
    """The examples run above are every ```python block of the page (a block the pattern missed
    would go untested), and each compiles, also where SmolLM2 is absent and they are skipped."""
    assert EXAMPLES and len(EXAMPLES) == PAGE.read_text().count("```python")
    for i, code in enumerate(EXAMPLES):
        compile(code, f"{PAGE} example {i + 1}", "exec")


def _workers() -> list[int]:
    """This process's worker processes (Python's own resource tracker, which outlives every
    shared-memory user of the interpreter, is not ours)."""
    out = []
    for pid in children_of(os.getpid()):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"_worker" in cmd:
            out.append(pid)
    return out


def test_no_resource_tracker_process_is_started(tiny_model, no_leaks):
    """The shared segment is made without multiprocessing's SharedMemory, whose resource tracker
    is a process of its own (14 MB resident) doing what the run's reaper does. In a fresh
    interpreter: the tracker is one per interpreter, and this one may have started it already."""
    script = f"""
import os, sparseinfer
with sparseinfer.LLM({str(tiny_model)!r}, threads=2, cpu_workers=1, sparsity=0) as llm:
    llm.generate("hello", max_tokens=2)
    kids = open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()
    cmds = [open(f"/proc/{{k}}/cmdline", "rb").read() for k in kids]
    print(sum(b"_worker" in c for c in cmds), sum(b"resource_tracker" in c for c in cmds))
"""
    out = subprocess.run([sys.executable, "-c", script], env=repo_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    workers, trackers = map(int, out.stdout.split()[-2:])
    assert workers >= 1 and trackers == 0


def test_an_llm_closes_its_workers_and_shared_memory(tiny_model, no_leaks):
    import sparseinfer

    llm = sparseinfer.LLM(tiny_model, threads=2, cpu_workers=1, sparsity=0)
    assert llm.generate("hello", max_tokens=3) == "".join(llm.generate("hello", max_tokens=3, stream=True))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hello", max_tokens=2, temperature=-1)
    assert _workers()
    llm.close()
    llm.close()  # idempotent
    assert not _workers()  # and no segment left: no_leaks


def test_penalties_reach_the_tokens_generate_picks(tiny_model):
    """Greedy decoding of a tiny random model repeats itself; a strong presence penalty, which
    looks back over the prompt and what was generated, must change what comes out (it was
    accepted and ignored: the engine's loop never gave the sampler the history)."""
    import sparseinfer

    with sparseinfer.LLM(tiny_model, threads=2, cpu_workers=1, sparsity=0) as llm:
        ids = llm.tokenizer.encode
        plain = ids(llm.generate("the lazy dog", max_tokens=24, ignore_eos=True))
        penalized = ids(llm.generate("the lazy dog", max_tokens=24, ignore_eos=True, presence_penalty=2.0,
                                     repeat_penalty=10.0))
        assert penalized != plain
        assert len(set(penalized)) > len(set(plain))  # fewer repeats
