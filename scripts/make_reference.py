"""Build the exact greedy-decoding oracle for SmolLM2-135M-Instruct Q4_1.

transformers' GGUF loader dequantizes the file to float32; we greedily decode with a
manual loop (prompt once, then one token at a time with the KV cache, argmax of the
float32 logits) and write:

  tests/fixtures/smollm2_reference.json        prompts, ids, per-step top-2 margins, versions
  tests/fixtures/smollm2_reference_logits.npz  full-vocab logits, arrays p{i}_step{k}

Usage: python scripts/make_reference.py [--model PATH] [--new-tokens 64] [--no-check]
       python scripts/make_reference.py --type Q3_K   # the same model requantized (below)

--type Q3_K|Q2_K|IQ4_XS: the oracle for a real model in a low-bit type. The Q4_1 file is
requantized by tests/fixtures/lowbit_smollm2.py (this project's numpy quantizers, the same bytes
wherever they run: the file's sha256 is stored and checked by the test), transformers decodes
it the same way, and tests/fixtures/smollm2_<type>_reference.json gets the ids and margins (no
logits file).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.fixtures.lowbit_smollm2 import sha256  # noqa: E402  (the file's hash, as the tests check it)
DEFAULT_MODEL = Path.home() / ".cache/sparseinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURES = REPO / "tests" / "fixtures"
LOGIT_STEPS = (0, 32)  # generated steps whose full logits are stored

# (name, kind, text); kind "chat" means: render text as one user turn with the chat template.
PROMPTS = [
    ("english", "plain", "The history of the printing press begins in"),
    ("chat", "chat", "Give me three short tips for staying focused while studying."),
    ("code", "plain", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("factual", "plain", "Question: What is the capital of France?\nAnswer:"),
]


def load(model_path: Path):
    """Tokenizer and float32 model through transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(model_path.parent), model_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return tok, model


def render(tok, kind: str, text: str) -> str:
    if kind == "chat":
        msgs = [{"role": "user", "content": text}]
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], n_new: int):
    """Plain greedy argmax with the KV cache. Returns (ids, margins, {step: logits})."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    ids, margins, kept = [], [], {}
    for step in range(n_new):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        if step in LOGIT_STEPS:
            kept[step] = logits.numpy().copy()
        nxt = int(torch.argmax(logits))
        ids.append(nxt)
        if step + 1 < n_new:
            out = model(input_ids=torch.tensor([[nxt]]),
                        past_key_values=out.past_key_values, use_cache=True)
    return ids, margins, kept


def run_all(tok, model, prompts, n_new: int):
    results = []
    for name, kind, text in prompts:
        rendered = render(tok, kind, text)
        pids = tok.encode(rendered, add_special_tokens=False)
        t0 = time.perf_counter()
        ids, margins, kept = greedy(model, pids, n_new)
        results.append(dict(name=name, kind=kind, text=text, prompt_text=rendered,
                            prompt_ids=pids, generated_ids=ids,
                            generated_text=tok.decode(ids), margins=margins,
                            seconds=time.perf_counter() - t0, logits=kept))
    return results


def check_repeat(tok, model, prompts, n_new, first) -> dict:
    """Rerun with a different thread count; compare ids and stored logits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    again = run_all(tok, model, prompts, n_new)
    torch.set_num_threads(threads)
    same = [a["generated_ids"] == b["generated_ids"] for a, b in zip(first, again)]
    diff = max(float(np.abs(a["logits"][s] - b["logits"][s]).max())
               for a, b in zip(first, again) for s in a["logits"])
    return dict(rerun_threads=1 if threads > 1 else 2, same_ids=all(same),
                same_ids_per_prompt=same, max_abs_logit_diff=diff)


def write(results, model_path: Path, model, n_new, check, out_dir: Path, stem: str = "smollm2",
          logits: bool = True, qtype: str | None = None):
    import gguf
    import transformers

    npz = None
    if logits:
        arrays = {f"p{i}_step{s}": r["logits"][s].astype(np.float32)
                  for i, r in enumerate(results) for s in LOGIT_STEPS if s in r["logits"]}
        npz = out_dir / f"{stem}_reference_logits.npz"
        np.savez_compressed(npz, **arrays)
    prompts = [{k: v for k, v in r.items() if k != "logits"} for r in results]
    for i, p in enumerate(prompts):
        p["min_margin"] = min(p["margins"])
        if logits:
            p["logits_arrays"] = [f"p{i}_step{s}" for s in LOGIT_STEPS]
    meta = dict(
        model_file=model_path.name, model_sha256=sha256(model_path),
        method="transformers GGUF loader, float32, manual greedy loop with KV cache "
               "(argmax each step, no eos stop, no repetition penalty)",
        attn_implementation=model.config._attn_implementation,
        new_tokens=n_new, logit_steps=list(LOGIT_STEPS), logits_dtype="float32",
        torch_threads=torch.get_num_threads(),
        versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                      gguf=getattr(gguf, "__version__", None) or _dist_version("gguf"),
                      numpy=np.__version__, python=sys.version.split()[0]),
        command="python " + " ".join(sys.argv),
        repeat_check=check, prompts=prompts)
    if qtype:
        meta["requantized"] = dict(type=qtype, by="tests/fixtures/lowbit_smollm2.py write_lowbit_copy",
                                   source=DEFAULT_MODEL.name)
    js = out_dir / f"{stem}_reference.json"
    js.write_text(json.dumps(meta, indent=1) + "\n")
    return js, npz


def _dist_version(name: str):
    from importlib.metadata import version
    return version(name)


def summary(results, check, js: Path, npz: Path):
    for i, r in enumerate(results):
        m = np.array(r["margins"])
        print(f"[p{i} {r['name']}] {len(r['prompt_ids'])} prompt ids, {r['seconds']:.1f}s, "
              f"min margin {m.min():.4f} at step {int(m.argmin())}, "
              f"steps with margin<0.1: {int((m < 0.1).sum())}")
        print("   ", repr(r["generated_text"][:160]))
    if check:
        print("repeat check:", check)
    print(f"wrote {js.relative_to(REPO)} ({js.stat().st_size} B)"
          + (f", {npz.relative_to(REPO)} ({npz.stat().st_size} B)" if npz else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=FIXTURES)
    ap.add_argument("--no-check", action="store_true", help="skip the rerun with other threads")
    ap.add_argument("--type", choices=["Q3_K", "Q2_K", "IQ4_XS"],
                    help="the model requantized to this type (tests/fixtures/lowbit_smollm2.py)")
    args = ap.parse_args()
    if args.new_tokens <= max(LOGIT_STEPS):
        ap.error(f"--new-tokens must exceed {max(LOGIT_STEPS)}")

    torch.set_num_threads(args.threads)
    model_path, stem = args.model, "smollm2"
    if args.type:
        import tempfile

        from tests.fixtures.lowbit_smollm2 import write_lowbit_copy

        stem = f"smollm2_{args.type.lower()}"
        model_path = write_lowbit_copy(args.model, Path(tempfile.mkdtemp()) / f"SmolLM2-135M-Instruct.{args.type}.gguf",
                                       args.type)
    tok, model = load(model_path)
    results = run_all(tok, model, PROMPTS, args.new_tokens)
    check = None if args.no_check else check_repeat(tok, model, PROMPTS, args.new_tokens, results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    js, npz = write(results, model_path, model, args.new_tokens, check, args.out_dir, stem,
                    logits=not args.type, qtype=args.type)
    summary(results, check, js, npz)


if __name__ == "__main__":
    main()
