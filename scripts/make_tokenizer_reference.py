"""Record transformers' GGUF tokenizer output as the reference for tests/test_tokenizer.py.

Needs the `reference` extra (transformers). Run once, from the repository root:

    python scripts/make_tokenizer_reference.py

It tokenizes a set of strings and renders chats with the SmolLM2 GGUF (from ~/.cache/sparseinfer/models)
and with the tiny sentencepiece GGUF that the tests build, and writes
tests/fixtures/tokenizer_reference.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import transformers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from test_tokenizer import FIXTURE, SMOLLM2, write_spm_gguf  # noqa: E402

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "12345 3.14 -0.5e10 1,000,000",
    "héllo wörld — 日本語 🤖",
    "   leading and trailing spaces   ",
    " one leading space",
    "tabs\tand\t\tmultiple    spaces",
    "line one\nline two\n\n\nline five\r\n",
    "I'm sure they've said it's fine, we'll see; DON'T.",
    "",
    "émojis 👍🏽 👨‍👩‍👧 and ümlauts",
    "https://example.com/path?q=1&r=two#frag",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Ελληνικά, русский, العربية, हिन्दी",
]
SMOLLM2_TEXTS = TEXTS + [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after special<|im_end|> and more",
]
SPM_TEXTS = TEXTS + [
    "hello the world is an quick fox",
    "[INST] hello world [/INST] hi</s>",
    "<s>hello</s>",
    "a<think>b</think> c",
]
CHATS = [
    ([{"role": "user", "content": "What is 2+2?"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Tell me a joke about 日本."}], False),
]


def record(tokenizer, texts: list[str]) -> dict:
    cases = []
    for text in texts:
        ids = tokenizer.encode(text)
        cases.append({"text": text, "ids": ids, "decoded": tokenizer.decode(ids)})
    chats = []
    for messages, add_generation_prompt in CHATS:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        chats.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "text": text,
                      "ids": tokenizer.encode(text, add_special_tokens=False)})
    return {"cases": cases, "chats": chats}


# Where transformers' GGUF loader and llama.cpp split SmolLM2 text differently (transformers
# skips the digit pass of pre "smollm"); the tests follow llama.cpp here.
SMOLLM2_DIVERGENT = ["   8 x", "g\r\n1234567", "a  2b", "x\n\n 42", "1 2  3   4"]


def record_llama_cpp(path: Path, tokenizer, texts: list[str]) -> list[dict] | None:
    try:
        import llama_cpp  # the `bench` extra
    except ImportError:
        print("llama_cpp not importable: skipping the llama.cpp cases")
        return None
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True),
             "transformers_ids": tokenizer.encode(t)} for t in texts]


def load(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def main() -> None:
    out = {"transformers_version": transformers.__version__}
    if not SMOLLM2.exists():
        sys.exit(f"{SMOLLM2} not found: fetch the SmolLM2 GGUF first")
    smollm2 = load(SMOLLM2)
    out["smollm2"] = record(smollm2, SMOLLM2_TEXTS)
    if (cases := record_llama_cpp(SMOLLM2, smollm2, SMOLLM2_DIVERGENT)) is not None:
        out["smollm2"]["llama_cpp_cases"] = cases
    with tempfile.TemporaryDirectory() as tmp:
        out["spm"] = record(load(write_spm_gguf(Path(tmp) / "spm.gguf")), SPM_TEXTS)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
