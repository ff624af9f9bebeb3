"""Build the transformers oracle for Gemma 3 270M Q4_K_M (`sparseinfer pull gemma3-270m`).

transformers' GGUF loader dequantizes the file to float32 (it reads arch gemma3, undoing the
converter's 1 + w norms); greedy decoding as scripts/make_reference.py does for SmolLM2 (its
load/greedy are reused), prompts tokenized by transformers with the BOS token the model expects.
Writes tests/fixtures/gemma3_270m_reference.json and gemma3_270m_reference_logits.npz: the first
step's logits at a sample of the 262k-token vocabulary (the top 512, best first, and every 512th
id), which keeps the fixture small.

Usage: /tmp/refvenv/bin/python scripts/make_gemma3_reference.py [--model PATH] [--new-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import make_reference as mr  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/gemma-3-270m-q4_k_m.gguf"
PROMPTS = [
    ("english", "The history of the printing press begins in"),
    ("factual", "Question: What is the capital of France?\nAnswer:"),
    ("code", "def fibonacci(n):\n"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok, model = mr.load(args.model)
    import transformers
    out, arrays = [], {}
    for i, (name, text) in enumerate(PROMPTS):
        pids = tok.encode(text, add_special_tokens=True)
        ids, margins, kept = mr.greedy(model, pids, args.new_tokens)
        arrays[f"p{i}_ids"], arrays[f"p{i}_logits"] = logit_sample(kept[0].astype(np.float32))
        out.append(dict(name=name, prompt_text=text, prompt_ids=pids, generated_ids=ids,
                        generated_text=tok.decode(ids), min_margin=min(margins)))
        print(name, repr(tok.decode(ids)), "min margin", min(margins), flush=True)
    meta = dict(model_file=args.model.name, model_sha256=mr.sha256(args.model),
                method="transformers GGUF loader, float32, greedy with KV cache (scripts/make_reference.py)",
                versions=dict(torch=torch.__version__, transformers=transformers.__version__),
                new_tokens=args.new_tokens, prompts=out)
    (REPO / "tests/fixtures/gemma3_270m_reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    np.savez_compressed(REPO / "tests/fixtures/gemma3_270m_reference_logits.npz", **arrays)


def logit_sample(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, logits at them): the top 512, best first, then every 512th id of the vocabulary."""
    top = np.argsort(-logits, kind="stable")[:512]
    ids = np.concatenate([top, np.setdiff1d(np.arange(0, len(logits), 512), top)]).astype(np.int32)
    return ids, logits[ids]


if __name__ == "__main__":
    main()
