"""Text for calibration and perplexity: a user's file, or English that ships with Python.

The default is `pydoc_data.topics` (Python's help texts, ~0.5 MB of English prose and code),
joined in key order and split once, deterministically, at the paragraph break nearest its
middle: the first part calibrates (thresholds, profiles, predictors), the second is held out
for perplexity, so no number is measured on the text it was tuned on.
"""
from __future__ import annotations

from pathlib import Path


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def split(text: str) -> tuple[str, str]:
    """(calibration, held-out) halves, cut at the paragraph break nearest the middle."""
    mid = len(text) // 2
    cut = text.find("\n\n", mid)
    if cut < 0:
        cut = mid
    return text[:cut], text[cut:].lstrip("\n")


def load(corpus: str | None, part: str) -> str:
    """`part` is "calibration" or "heldout"; a user's file is split the same way."""
    if corpus:
        p = Path(corpus)
        if not p.is_file():
            raise ValueError(f"{corpus}: corpus file not found")
        text = p.read_text(encoding="utf-8", errors="replace")
    else:
        text = default_text()
    calib, held = split(text)
    return calib if part == "calibration" else held


def token_chunks(ids: list[int], chunk_len: int, n_chunks: int | None) -> list[list[int]]:
    """Consecutive non-overlapping windows of `chunk_len` tokens (the last partial one dropped)."""
    if chunk_len < 2:
        raise ValueError("chunk length must be at least 2 tokens")
    chunks = [ids[i:i + chunk_len] for i in range(0, len(ids) - chunk_len + 1, chunk_len)]
    if not chunks:
        raise ValueError(f"corpus has {len(ids)} tokens, fewer than one chunk of {chunk_len}")
    return chunks if n_chunks is None else chunks[:n_chunks]
