"""Reasoning models' thinking, kept apart from the answer: the splitters that turn a reply's text,
as it arrives, into (thinking, answer, tool calls).

Two families, told apart by the chat template (`family_of`):
- "think" (Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3): the reply opens with
  `<think>`, thinks, closes with `</think>`, then answers. Templates that open the block in the
  prompt themselves (DeepSeek-R1, Qwen3-*-Thinking-2507: the prompt ends with `<think>\\n`)
  start the reply inside it (`ThinkSplitter(opened=True)`); a template that wrote an empty,
  closed block (Qwen3 with enable_thinking false) gives a reply with none.
- "harmony" (gpt-oss): the reply is messages `<|channel|>C<|message|>BODY<|end|>`, each after a
  `<|start|>assistant` header: channel analysis is thinking, final (and commentary without a
  recipient: a preamble) the answer, and a message addressed `to=functions.NAME` a tool call
  whose body is the arguments. Its markers are control tokens, so such a request keeps control
  tokens' text in its output (batching.Request.keep_special).

Markers may arrive split across pieces of text: whatever could be the start of one is held back
until the next piece decides, as the tool-call parser does.
"""
from __future__ import annotations

import json
import re

from .tool_calls import Call, CallParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
H_CALL, H_RETURN, H_CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
_H_BODY_ENDS = (H_END, H_CALL, H_RETURN, H_START)


def family_of(template: str | None) -> str:
    """"harmony" for gpt-oss's templates, else "think" (a reply that does not open with <think>
    is all answer, so models that never think lose nothing)."""
    return "harmony" if template and H_CHANNEL in template and H_MESSAGE in template else "think"


def splitter_for(family: str, prompt_tail: str, tools: set[str] | None = None):
    """The splitter of a reply to a prompt ending in `prompt_tail` (its last tokens, control
    tokens spelled out): a think block the prompt opened, or harmony's header it began."""
    if family == "harmony":
        return HarmonySplitter(prompt_tail, tools)
    return ThinkSplitter(opened=prompt_tail.rstrip().endswith(THINK_OPEN))


def _held(buf: str, marker: str) -> int:
    """How many characters at the end of `buf` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class _Trim:
    """A part's text without its leading whitespace and, where `tail`, its trailing whitespace
    (held back until more text follows it: the newlines around a thought are the markers')."""

    def __init__(self, tail: bool):
        self.tail, self.started, self.pending = tail, False, ""

    def push(self, s: str) -> str:
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        if not self.tail:
            return s
        s = self.pending + s
        body = s.rstrip()
        self.pending = s[len(body):]
        return body


class ThinkSplitter:
    """`<think>...</think>` apart from the answer. `opened`: the prompt opened the block, so the
    reply begins inside it. An unclosed block (cut by max_tokens) is all thinking."""

    def __init__(self, opened: bool = False):
        self.state = "think" if opened else "start"
        self.buf = ""
        self.thought, self.answer = _Trim(tail=True), _Trim(tail=False)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking, answer) now certain."""
        self.buf += text
        thinking, answer = [], []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf, self.state = head[len(THINK_OPEN):], "think"
                    continue
                if not final and THINK_OPEN.startswith(head):  # nothing yet, or the marker's start
                    break
                self.state = "plain"  # no thinking: the text as it came
                continue
            if self.state == "think":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    thinking.append(self.thought.push(self.buf[:i]))
                    self.buf, self.state = self.buf[i + len(THINK_CLOSE):], "answer"
                    continue
                cut = len(self.buf) if final else len(self.buf) - _held(self.buf, THINK_CLOSE)
                thinking.append(self.thought.push(self.buf[:cut]))
                self.buf = self.buf[cut:]
                break
            out, self.buf = self.buf, ""
            answer.append(self.answer.push(out) if self.state == "answer" else out)
            break
        return "".join(thinking), "".join(answer)


class HarmonySplitter:
    """gpt-oss's harmony messages as (thinking, answer, calls). `prompt_tail`: the end of the
    prompt, which may have begun the first message's header (`<|start|>assistant`) or all of it.
    `tools`: the names the request offered; a call of another function is shown as text."""

    def __init__(self, prompt_tail: str = "", tools: set[str] | None = None):
        self.tools = tools or set()
        self.calls: list[Call] = []
        start = prompt_tail.rfind(H_START)
        head = prompt_tail[start + len(H_START):] if start >= 0 else ""
        if H_MESSAGE in head and not any(m in head.split(H_MESSAGE)[-1] for m in _H_BODY_ENDS):
            self.state, self.header, self.buf = "body", head.split(H_MESSAGE)[0], ""
        else:
            self.state, self.header, self.buf = "header", "", ""
        self.body = ""  # a tool call's arguments so far

    def _route(self) -> str:
        """Where the current message's body goes: "thinking", "answer" or "call"."""
        to = re.search(r"\bto=([^\s<]+)", self.header)
        if to:
            return "call"
        channel = re.search(re.escape(H_CHANNEL) + r"\s*(\w+)", self.header)
        return "thinking" if channel and channel.group(1) == "analysis" else "answer"

    def _recipient(self) -> str:
        return re.search(r"\bto=([^\s<]+)", self.header).group(1)

    def _end_message(self, thinking: list, answer: list, calls: list) -> None:
        if self._route() == "call":
            name = self._recipient().removeprefix("functions.")
            args = self.body.strip()
            try:
                args = json.dumps(json.loads(args), ensure_ascii=False)
            except json.JSONDecodeError:
                pass  # as written: the client sees what the model meant to send
            if name in self.tools:
                calls.append(Call(name, args))
            else:
                answer.append(self.body)
        self.header, self.body, self.state = "", "", "header"

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[Call]]:
        self.buf += text
        thinking: list[str] = []
        answer: list[str] = []
        calls: list[Call] = []
        while True:
            if self.state == "header":
                i = self.buf.find(H_MESSAGE)
                if i < 0:
                    if final:  # no message ever began: whatever came is the answer
                        answer.append(re.sub(r"<\|[a-z]+\|>", "", self.buf).strip())
                        self.buf = ""
                    break
                self.header += self.buf[:i]
                self.header = self.header[self.header.rfind(H_START) + len(H_START):] if H_START in self.header \
                    else self.header
                self.buf, self.state = self.buf[i + len(H_MESSAGE):], "body"
                continue
            ends = [(j, m) for m in _H_BODY_ENDS if (j := self.buf.find(m)) >= 0]
            if ends:
                j, marker = min(ends)
                self._emit(self.buf[:j], thinking, answer)
                self.buf = self.buf[j + (0 if marker == H_START else len(marker)):]
                self._end_message(thinking, answer, calls)
                continue
            cut = len(self.buf)
            if not final:  # hold a marker's possible beginning
                k = self.buf.rfind("<|")
                if k >= 0 and "|>" not in self.buf[k:]:
                    cut = k
                elif self.buf.endswith("<"):
                    cut -= 1
            self._emit(self.buf[:cut], thinking, answer)
            self.buf = self.buf[cut:]
            if final:
                self._end_message(thinking, answer, calls)
            break
        self.calls += calls
        return "".join(thinking), "".join(answer), calls

    def _emit(self, s: str, thinking: list, answer: list) -> None:
        route = self._route()
        if route == "call":
            self.body += s
        else:
            (thinking if route == "thinking" else answer).append(s)


class ReplySplitter:
    """A chat reply's text as (thinking, answer, tool calls), each as soon as it is certain:
    the thinking splitter first, then, on the answer, the tool-call parser of the request's
    call format (harmony finds its own calls). `calls`: every call found so far."""

    def __init__(self, thinking: "ThinkSplitter | HarmonySplitter | None", calls: CallParser | None):
        self.thinking, self.parser = thinking, calls
        self.calls: list[Call] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[Call]]:
        if isinstance(self.thinking, HarmonySplitter):
            thought, answer, calls = self.thinking.feed(text, final)
        else:
            thought, answer = self.thinking.feed(text, final) if self.thinking else ("", text)
            calls = []
            if self.parser is not None:
                answer, calls = self.parser.finish(answer) if final else self.parser.feed(answer)
        self.calls += calls
        return thought, answer, calls
