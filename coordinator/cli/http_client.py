"""A small client of the server's OpenAI-compatible API for `sparseinfer prompt`: standard
library only (no extra dependency for a command-line client), streaming over SSE."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

DEFAULT_URL = "http://127.0.0.1:8080"


class ClientError(Exception):
    """One line for the user: no server, a refused key, an error the server returned."""


def stream_completion(url: str, body: dict, api_key: str | None = None, timeout: float = 600.0) -> Iterator[dict]:
    """POST `body` (with stream=True) to url's /v1/chat/completions or /v1/completions (by
    whether it has messages) and yield the SSE chunks as dicts."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise ClientError(f"{url}: HTTP {e.code}: {_error_message(e.read())}") from None
    except urllib.error.URLError as e:
        raise ClientError(f"no server at {url} ({getattr(e.reason, 'strerror', None) or e.reason}); "
                          f"start one with `sparseinfer serve`") from None
    except (TimeoutError, OSError) as e:
        raise ClientError(f"{url}: {e}") from None
    with resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                raise ClientError(f"{url}: the server sent a malformed event: {data[:80]!r}") from None
            if "error" in chunk:
                raise ClientError(f"{url}: {chunk['error'].get('message', chunk['error'])}")
            yield chunk


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200] or "no details"


def chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or "" if "delta" in c else c.get("text") or ""
