"""OpenAI's response objects for one request: chat.completion and text_completion, whole or
as chunks, with logprobs, usage, tool calls and a reasoning model's thinking (reasoning_content)."""
from __future__ import annotations

import time

from ..runtime.batching import DoneEvent, TokenEvent
from .reasoning import ReplySplitter
from .state import ServerState


class ReplyFormat:
    """OpenAI's response objects for one request."""

    def __init__(self, state: ServerState, rid: str, chat: bool, logprobs: bool, tokenizer,
                 splitter: "ReplySplitter | None" = None):
        self.model, self.rid, self.chat, self.logprobs, self.tk = state.model_id, rid, chat, logprobs, tokenizer
        self.created = int(time.time())
        self.offset = 0  # completions' text_offset: characters of the tokens before
        self.splitter = splitter  # thinking and tool calls apart from the answer (reasoning.py)

    def split(self, text: str, final: bool = False) -> tuple[str, str, list]:
        """(thinking, content, tool calls completed) of the reply's next text."""
        if self.splitter is None:
            return "", text, []
        return self.splitter.feed(text, final)

    def finish_reason(self, done: DoneEvent) -> str:
        if self.splitter is not None and self.splitter.calls and done.reason == "stop":  # cut short: "length"
            return "tool_calls"
        return done.reason if done.reason != "cancelled" else "stop"

    def call_chunk(self, call) -> dict:
        index = self.splitter.calls.index(call)
        return self.chunk({"tool_calls": [call.as_openai(index)]}, None, None)

    def _piece(self, tok: int) -> tuple[str, list[int]]:
        b = self.tk.piece_bytes(tok) if not self.tk.is_special(tok) else self.tk.tokens[tok].encode()
        return b.decode("utf-8", "replace"), list(b)

    def _logprobs(self, infos: list[TokenEvent]):
        if not self.logprobs or not infos:
            return None
        if self.chat:
            content = []
            for ev in infos:
                s, b = self._piece(ev.token)
                top = [{"token": (p := self._piece(t))[0], "logprob": lp, "bytes": p[1]} for t, lp in (ev.top or [])]
                content.append({"token": s, "logprob": ev.logprob, "bytes": b, "top_logprobs": top})
            return {"content": content}
        tokens, lps, tops, offsets = [], [], [], []
        for ev in infos:
            s = self._piece(ev.token)[0]
            tokens.append(s)
            lps.append(ev.logprob)
            tops.append({self._piece(t)[0]: lp for t, lp in (ev.top or [])})
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _usage(self, done: DoneEvent) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    def chunk(self, delta, infos, finish: str | None) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": self._logprobs(infos) if infos else None,
                      "finish_reason": finish}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": self._logprobs(infos) if infos else None,
                  "finish_reason": finish}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self, done: DoneEvent) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage(done)}

    def whole(self, text: str, infos: list[TokenEvent], done: DoneEvent) -> dict:
        thought, text, calls = self.split(text, final=True)
        reason = self.finish_reason(done)
        if self.chat:
            message = {"role": "assistant", "content": text}
            if calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": [c.as_openai() for c in calls]}
            if thought:  # llama-server's and vLLM's field: clients that know it show it apart
                message["reasoning_content"] = thought
            choice = {"index": 0, "message": message,
                      "logprobs": self._logprobs(infos), "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(infos), "finish_reason": reason}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage(done)}
