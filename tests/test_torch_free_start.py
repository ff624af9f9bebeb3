"""A model in the file's blocks (llama's family, falcon's) starts and decodes without torch in the
coordinator (its import is about 1 s of start-up: docs/PERFORMANCE.md, "Start-up"); a path that
needs torch (float copies, here `--weights f32`) imports it on first use and gives the same
tokens; and torch imported late still gets the thread count the engine chose for it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import HANG_S, REPO
from tests.fixtures.child_env import repo_env
from tests.fixtures.tiny_arch import write_tiny_arch

# `generate` as `python -m coordinator` runs it, then whether torch was imported, on stdout
# (generate ends with os._exit once its output is flushed: the report goes just before)
WRAP = ("import os, runpy, sys\n"
        "def report():\n"
        "    print('\\n[torch imported: %s]' % ('torch' in sys.modules), flush=True)\n"
        "exit_now = os._exit\n"
        "os._exit = lambda code: (report(), exit_now(code))\n"
        "runpy.run_module('coordinator', run_name='__main__', alter_sys=True)\n"
        "report()\n")


def _generate(model, *extra) -> tuple[str, bool]:
    r = subprocess.run([sys.executable, "-c", WRAP, "generate", "-m", str(model), "-p", "hello", "-n", "6",
                        "--threads", "2", "--cpu-workers", "1", "--sparsity", "0", "--seed", "0", *extra],
                       capture_output=True, cwd=REPO, env=repo_env(), timeout=HANG_S)
    out = r.stdout.decode(errors="replace")
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    text, _, flag = out.rpartition("[torch imported: ")
    return text, flag.startswith("True")


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q8_0"])
def test_llama_in_the_files_blocks_never_imports_torch(tiny_model_factory, tensor_type):
    path = tiny_model_factory(tensor_type=tensor_type)
    text, torch_loaded = _generate(path, "--arith", "exact")
    assert not torch_loaded
    # it did generate: generate echoes the prompt, then prints what it decoded after it
    assert "hello" in text and text.split("hello", 1)[1].strip(), text
    # float copies of the same file go through torch's products: imported there, same greedy tokens
    text_f32, torch_loaded = _generate(path, "--arith", "exact", "--weights", "f32")
    assert torch_loaded
    assert text_f32 == text


@pytest.mark.parametrize("arch", ["falcon", "falcon40b"])
def test_falcon_in_the_files_blocks_never_imports_torch(tmp_path, arch):
    """Falcon's LayerNorms and parallel blocks are the native kernels' too (its attention step,
    the FFN input's and output norm's LayerNorm): nothing of its forward pass needs torch."""
    text, torch_loaded = _generate(write_tiny_arch(tmp_path / f"{arch}.gguf", arch), "--arith", "exact")
    assert not torch_loaded
    assert "hello" in text and text.split("hello", 1)[1].strip(), text


def test_torch_imported_late_gets_the_engines_thread_count():
    code = ("import coordinator, sys\n"
            "assert 'torch' not in sys.modules\n"
            "coordinator.set_torch_threads(1)\n"
            "import torch\n"
            "print(torch.get_num_threads())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=REPO, env=repo_env(), timeout=HANG_S)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout.decode().split() == ["1"]
