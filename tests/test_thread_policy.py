"""Our processes choose their OpenMP wait policy for themselves only: importing the engine makes
libgomp (loaded with torch) sleep instead of spinning between parallel regions, and leaves no
OMP_WAIT_POLICY in the environment that programs started from, or loaded into, the process
inherit (a leaked PASSIVE once slowed llama.cpp 3x in our benchmark)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _spin_count(code: str) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints its settings when it loads
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"GOMP_SPINCOUNT = '(\d+)'", r.stderr)
    if m is None:
        pytest.skip("this torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT shown)")
    return m.group(1), r.stdout.strip()


def test_engine_import_makes_openmp_passive_without_exporting_it():
    spins, leaked = _spin_count("import coordinator.engine, os; print('OMP_WAIT_POLICY' in os.environ)")
    assert spins == "0"  # passive: threads sleep at once
    assert leaked == "False"


def test_plain_torch_keeps_its_default():
    """The control: without our package libgomp spins (so the test above can fail)."""
    spins, _ = _spin_count("import torch")
    assert spins != "0"
