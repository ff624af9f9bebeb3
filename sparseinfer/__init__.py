"""sparseinfer's Python API: a GGUF model run in this process (its workers started beside it),
text in and text out, as the command line's `generate` and `chat` do (docs/PYTHON_API.md).

    import sparseinfer

    with sparseinfer.LLM() as llm:                      # the default model (SmolLM2), pulled if needed
        print(llm.generate("The capital of France is", max_tokens=8))
        for piece in llm.chat([{"role": "user", "content": "Say hi"}], stream=True):
            print(piece, end="", flush=True)

Everything an engine takes (coordinator.runtime.engine.EngineOptions: threads, cpu_workers, ctx,
weights, fast, ...) is a keyword of LLM; sampling keywords are SamplingParams' fields
(temperature, top_k, top_p, min_p, seed, repeat_penalty, presence_penalty, frequency_penalty,
repeat_last_n). Leaving the `with` block (or close()) stops the workers and frees the shared
memory; an LLM left open is closed when it is dropped or the interpreter exits.
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Iterator

__all__ = ["LLM", "SamplingParams"]

from coordinator.runtime.sampling import SamplingParams  # noqa: E402


class LLM:
    """One model, loaded once, for many generate / chat calls (one at a time).

    model: a GGUF path (default: SmolLM2-135M-Instruct, pulled into the cache on first use).
    sparsity: "auto" (the calibrated level within +2 % perplexity, as `generate` picks it; dense
    without a calibration), a level, or 0 / None for dense.
    A value the command line refuses is refused here too, before the model is read or fetched,
    with the same words and the keyword's name: ValueError("threads 64: this machine has 2
    usable cores: choose 1..2") (coordinator/runtime/engine_options.py)."""

    def __init__(self, model: str | Path | None = None, *, sparsity: float | str | None = "auto", **options):
        from coordinator.runtime.engine import Engine, EngineOptions
        from coordinator.runtime.engine_options import check_values
        from coordinator.runtime.model_fetch import pull

        options.setdefault("spec", "ngram")  # speculative decoding where it pays, as the command line
        opts = EngineOptions(**options)  # a keyword that is no option: TypeError naming it
        if sparsity != "auto":
            check_values(sparsity=sparsity)
            opts.sparsity = sparsity or None
        opts.validate()
        path = Path(model) if model is not None else pull(quiet=True)
        if sparsity == "auto":
            opts.sparsity = self._default_level(path, options)
        self.path = path
        self._engine = Engine(path, opts)
        self._close = weakref.finalize(self, self._engine.close)  # also at exit, or when dropped
        self.sparsity = self._engine.sparsity

    @staticmethod
    def _default_level(path: Path, options: dict) -> float | None:
        if options.get("weights", "gguf") != "gguf" or not options.get("fast", True) or options.get("predictor"):
            return None
        from coordinator.runtime.sparsity_level import choose

        return choose(path, options.get("sparse_method", "input"), say=False)[0]

    # ---- text ------------------------------------------------------------------------------

    def generate(self, prompt: str, max_tokens: int = 128, *, stream: bool = False, stop: list[str] | None = None,
                 ignore_eos: bool = False, json_schema: dict | None = None, regex: str | None = None,
                 grammar: str | None = None, **sampling) -> str | Iterator[str]:
        """The continuation of `prompt` (the text after it), whole or, with stream=True, as an
        iterator of pieces. Sampling keywords as SamplingParams' (default: greedy).
        `json_schema`, `regex` or `grammar` (GBNF or Lark) constrain the text to parse as given."""
        ids = self.tokenizer.encode(prompt)
        return self._run(ids, max_tokens, stream, stop, ignore_eos, sampling, json_schema, regex, grammar)

    def chat(self, messages: list[dict], max_tokens: int = 256, *, stream: bool = False,
             stop: list[str] | None = None, json_schema: dict | None = None, regex: str | None = None,
             grammar: str | None = None, **sampling) -> str | Iterator[str]:
        """The assistant's reply to `messages` ({"role", "content"} dicts, system/user/assistant),
        rendered with the model's own chat template. Sampling as `sparseinfer chat` samples: the
        model's recommended sampling, else llama.cpp's defaults, under the keywords given.
        `json_schema`, `regex` or `grammar` constrain the reply as in `generate`."""
        from coordinator.runtime.sampling import chat_defaults

        ids = self._engine.encode_chat(messages)
        return self._run(ids, max_tokens, stream, stop, False, {**chat_defaults(self._engine.store.reader),
                                                                **sampling}, json_schema, regex, grammar)

    def _run(self, ids: list[int], max_tokens: int, stream: bool, stop, ignore_eos: bool, sampling: dict,
             json_schema=None, regex=None, grammar=None):
        params = SamplingParams(**sampling)
        params.validate()
        constraint = self._constraint(json_schema, regex, grammar)  # a bad schema fails here, before any work
        pieces = self._pieces(ids, max_tokens, params, list(stop or []), ignore_eos, constraint)
        return pieces if stream else "".join(pieces)

    def _constraint(self, json_schema, regex, grammar):
        from coordinator.text.structured_output import Constraint, TokenTable, grammar_for

        g = grammar_for(json_schema=json_schema, regex=regex, grammar=grammar)
        if g is None:
            return None
        eng = self._engine
        return Constraint(TokenTable.of(eng.tokenizer, eng.model.cfg.vocab_size), g)

    def _pieces(self, ids, max_tokens, params, stop, ignore_eos, constraint=None) -> Iterator[str]:
        from coordinator.text.tokenizer import StreamDecoder

        eng, eos = self._engine, self._engine.tokenizer.eos_ids
        dec = StreamDecoder(eng.tokenizer, skip_special=True)
        text, sent = "", 0
        for tok in eng.generate(ids, max_tokens, params, stop_at_eos=not ignore_eos, constraint=constraint):
            if (not ignore_eos or constraint is not None) and tok in eos:
                break
            text += dec.push(tok)
            cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:  # a stop string: the text before it, and no more
                yield text[sent:cut]
                return
            # hold back what could still become the start of a stop string
            safe = len(text) - max((len(s) - 1 for s in stop), default=0)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        text += dec.flush()
        if len(text) > sent:
            yield text[sent:]

    def embed(self, texts: str | list[str]):
        """Unit-length embedding vectors (numpy float32): one text -> (hidden,), a list ->
        (len, hidden); pooled as the model's metadata says, else the mean of the last hidden
        states (coordinator/runtime/embedding.py)."""
        one = isinstance(texts, str)
        items = [texts] if one else list(texts)
        if not all(isinstance(t, str) for t in items):
            raise TypeError("embed takes a text or a list of texts")
        vectors = self._engine.embed([self.tokenizer.encode(t) for t in items])
        return vectors[0] if one else vectors

    # ---- the model and its life ------------------------------------------------------------

    @property
    def tokenizer(self):
        """The model's tokenizer (encode, decode, eos_ids)."""
        return self._engine.tokenizer

    def stats(self) -> dict:
        """The last call's prefill and decode times and token counts (Engine.stats)."""
        return self._engine.stats()

    def close(self) -> None:
        """Stop the workers and free the run's shared memory (idempotent)."""
        self._close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
