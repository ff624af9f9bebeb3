"""Text embeddings: a text's vector is its tokens' last hidden states (after the final norm)
pooled as the model's metadata says (GGUF `<arch>.pooling_type`: mean, cls or last; mean where
the file says none or nothing, as a decoder model's are), L2-normalized (llama-server's
default; OpenAI's vectors are unit length too).

`Embedder` runs several texts in one pass (Transformer.hidden_states: attention per text, the
FFN over all their rows at once, dense), each in a private KV cache of its own: a text's vector
is the same alone and beside others. `EmbedQueue` puts the server's embedding requests on the
scheduler's thread (coordinator/runtime/batching.py side work), all those waiting in one pass.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from sparsecore.gguf_file import field_value

# llama.cpp's enum llama_pooling_type, as GGUF files write it
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
MAX_PASS_TOKENS = 512  # rows of one pass (more texts wait for the next)
MAX_PASS_TEXTS = 16  # texts of one pass: each holds a KV cache while it runs


def pooling_of(reader, arch: str) -> str:
    """mean, cls or last: what the file's `<arch>.pooling_type` asks (mean where it asks none).
    A reranker's (rank) is refused in one line: its vectors are not embeddings."""
    raw = field_value(reader, f"{arch}.pooling_type")
    kind = POOLING_TYPES.get(int(raw), None) if isinstance(raw, (int, np.integer)) else None
    if raw is not None and kind is None:
        raise ValueError(f"{arch}.pooling_type {raw!r} is not a pooling llama.cpp defines (0..4)")
    if kind == "rank":
        raise ValueError("this model is a reranker (pooling_type rank): it scores pairs, it gives no embeddings")
    return "mean" if kind in (None, "none") else kind


def pool(states: np.ndarray, how: str) -> np.ndarray:
    """One text's token states (T, hidden) -> its unit-length vector (hidden,) float32."""
    v = states.mean(axis=0, dtype=np.float64) if how == "mean" else states[0 if how == "cls" else -1]
    v = np.asarray(v, np.float64)
    n = np.linalg.norm(v)
    return (v / n if n > 0 else v).astype(np.float32)


def per_row(engine) -> bool:
    """Whether every product of a pass is per row whatever the other rows (Embedder's
    `together`): fast arithmetic on the file's blocks, every layer's matrix block-quantized (the
    integer kernels quantize each row's activations on their own; float matrices, F16 included,
    go through products blocked by the batch's size)."""
    from sparsecore.kernels.formats import NATIVE_TYPES

    if engine.opts.weights != "gguf" or not engine.opts.fast:
        return False
    return all(NATIVE_TYPES.get(int(t.tensor_type), 1) > 1 for t in engine.store.reader.tensors
               if t.name.startswith("blk.") and len(t.shape) > 1)


class Embedder:
    """Vectors of token-id texts through `model` (a Transformer), pooled by `how`."""

    def __init__(self, model, how: str, together: bool = True):
        """together: several texts share a pass. Only where every product is per row whatever
        the other rows: the file's blocks in fast arithmetic (8-bit activations per row); float
        GEMMs (exact arithmetic, float weights) block by the batch's size, a text alone then
        rounding apart in the last bits, so each text runs a pass of its own."""
        from ..model.transformer import KVCache

        self.model, self.how = model, how
        self.max_texts = MAX_PASS_TEXTS if together else 1
        cfg = model.cfg
        # private caches (never the shared pool's): a text's attention then always runs here, in
        # one order, whoever else is in the pass
        self.new_cache = lambda: KVCache(cfg.n_layers, cfg.n_kv_heads, model.max_ctx, cfg.head_dim)  # noqa: E731
        self.caches: list = []

    @classmethod
    def for_engine(cls, engine) -> "Embedder":
        return cls(engine.model, pooling_of(engine.store.reader, engine.cfg.arch), per_row(engine))

    def check(self, texts: list[list[int]], vocab: int) -> None:
        """ValueError in one line for a text that cannot be embedded (empty, too long, bad ids)."""
        for i, ids in enumerate(texts):
            if not ids:
                raise ValueError(f"input {i} is empty: nothing to embed")
            if len(ids) > self.model.max_ctx:
                raise ValueError(f"input {i} has {len(ids)} tokens, more than the context size {self.model.max_ctx}")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"input {i}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def __call__(self, texts: list[list[int]]) -> np.ndarray:
        """(len(texts), hidden) float32 unit vectors, in passes of up to MAX_PASS_TOKENS rows."""
        out = np.empty((len(texts), self.model.cfg.hidden), np.float32)
        i = 0
        while i < len(texts):
            j, rows = i, 0
            while j < len(texts) and j - i < self.max_texts and (j == i or rows + len(texts[j]) <= MAX_PASS_TOKENS):
                rows += len(texts[j])
                j += 1
            batch = texts[i:j]
            while len(self.caches) < len(batch):
                self.caches.append(self.new_cache())
            states = self.model.hidden_states(batch, self.caches[:len(batch)])
            at = 0
            for k, ids in enumerate(batch):
                out[i + k] = pool(states[at:at + len(ids)], self.how)
                at += len(ids)
            i = j
        return out


class EmbedQueue:
    """Embedding requests run on the scheduler's thread between its steps (which owns the model),
    every request waiting then in one call of the embedder."""

    def __init__(self, scheduler, embedder: Embedder):
        self.scheduler, self.embedder = scheduler, embedder
        self.lock = threading.Lock()
        self.waiting: list[tuple[Future, list[list[int]]]] = []
        scheduler.side_work.append(self)

    @classmethod
    def of(cls, scheduler, engine) -> "EmbedQueue":
        """The scheduler's queue, made on first use."""
        with scheduler.cv:
            for w in scheduler.side_work:
                if isinstance(w, cls):
                    return w
            return cls(scheduler, Embedder.for_engine(engine))

    @property
    def pending(self) -> bool:
        return bool(self.waiting)

    def submit(self, texts: list[list[int]]) -> Future:
        fut: Future = Future()
        with self.scheduler.cv:
            if self.scheduler.error is not None:
                raise RuntimeError(self.scheduler.error)
            with self.lock:
                self.waiting.append((fut, texts))
            self.scheduler.cv.notify()
        return fut

    def fail(self, message: str) -> None:
        with self.lock:
            taken, self.waiting = self.waiting, []
        for fut, _ in taken:
            fut.set_exception(RuntimeError(message))

    def run(self) -> None:
        """On the scheduler's thread: every waiting request's texts in one call."""
        with self.lock:
            taken, self.waiting = self.waiting, []
        if not taken:
            return
        try:
            vectors = self.embedder([t for _, texts in taken for t in texts])
        except BaseException as e:  # the engine failed (a worker died): the scheduler fails the rest
            for fut, _ in taken:
                fut.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))
            raise
        at = 0
        for fut, texts in taken:
            fut.set_result(vectors[at:at + len(texts)])
            at += len(texts)
