"""POST /v1/embeddings in OpenAI's shape: `input` a text, a list of texts, a token array or a
list of token arrays; `encoding_format` float (lists of numbers) or base64 (little-endian
float32, what the official client asks for by default); `data[i].embedding` and `usage`.

The vectors are coordinator/runtime/embedding.py's (pooled by the model's metadata, else the
mean of the last hidden states; unit length), computed on the scheduler's thread between decode
steps, every request waiting then in one pass."""
from __future__ import annotations

import asyncio
import base64
from typing import Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from ..runtime.embedding import EmbedQueue
from .completion import check_model, checked_text, fits_at_all
from .state import ApiError, ServerState, off_loop

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _inputs(body: EmbeddingRequest) -> list:
    """The request's inputs as a list, each a text or a token array."""
    x = body.input
    if isinstance(x, str):
        return [x]
    if not x:
        raise ApiError(400, "input: an empty list, nothing to embed", param="input")
    if isinstance(x[0], int):
        return [x]
    if len(x) > MAX_INPUTS:
        raise ApiError(400, f"input: {len(x)} inputs, more than {MAX_INPUTS} in one request", param="input")
    return list(x)


def add_routes(app, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        sched = state.ready()
        check_model(state, body.model)
        eng = state.engine
        hidden = eng.cfg.hidden
        if body.dimensions is not None and body.dimensions != hidden:
            raise ApiError(400, f"dimensions: this model's embeddings have {hidden} dimensions, not "
                                f"{body.dimensions}", param="dimensions")
        items = _inputs(body)
        for i, x in enumerate(items):
            if isinstance(x, str):
                if not x:
                    raise ApiError(400, f"input[{i}]: an empty text, nothing to embed", param=f"input[{i}]")
                checked_text(x, f"input[{i}]")
                fits_at_all(state, len(x), f"input[{i}]")
        tk = eng.tokenizer

        def tokenize():
            return [tk.encode(x) if isinstance(x, str) else list(x) for x in items]
        texts = await off_loop(state, tokenize)
        try:
            queue = EmbedQueue.of(sched, eng)
            queue.embedder.check(texts, eng.cfg.vocab_size)
        except ValueError as e:  # a text too long or empty, a token outside the vocabulary, a reranker
            raise ApiError(400, str(e), param="input") from None
        try:
            vectors = await asyncio.wrap_future(queue.submit(texts))
        except RuntimeError as e:
            raise ApiError(500, f"the engine failed: {e}", "server_error") from None
        data = []
        for i, v in enumerate(vectors):
            v = np.asarray(v, dtype="<f4")
            emb = base64.b64encode(v.tobytes()).decode("ascii") if body.encoding_format == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(t) for t in texts)
        return {"object": "list", "data": data, "model": state.model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n}}
