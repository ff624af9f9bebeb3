"""docs/PYTHON_API.md's examples, run as they are written, and what they promise about the
processes and memory they leave."""
from __future__ import annotations

import os
import re

import pytest

from tests.conftest import REPO, children_of

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
