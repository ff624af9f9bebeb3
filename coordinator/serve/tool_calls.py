"""Tool calls (OpenAI's `tools`, `tool_choice`, `tool_calls`): how the tools reach the prompt,
how a reply's calls are found, and the grammar that makes a required call parse.

Each model family writes calls its own way; the chat template says which:
- "hermes" (Qwen 2.5 / 3, Hermes, and our fallback): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- "llama3" (Llama 3.1 / 3.2 / 3.3): the reply is one JSON object `{"name": ..., "parameters": {...}}`;
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
A template that takes `tools` gets them as the model was trained to see them (the variable, in
Hugging Face's `{"type": "function", "function": {...}}` shape). A template that does not
(SmolLM2's, Gemma 3's) gets the fallback: the tools and the hermes format described in the
system message, earlier calls written back as `<tool_call>` blocks and tool results as user
turns in `<tool_response>` blocks, consecutive turns of one role merged (templates that demand
alternating roles accept them).

The tools are shown whatever `tool_choice` says (the prompt, and so its cached keys, stays the
same from turn to turn). "auto" leaves decoding free and parses what comes; "none" parses
nothing; "required" and a named function constrain decoding (structured_output) to calls
whose arguments follow the tools' JSON schemas, so they always parse.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..text.structured_output import JSON_WHITESPACE

FORMATS = ("hermes", "llama3", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"

FALLBACK_PROMPT = (
    "You can call functions to answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n\n"
    "To call one, reply with a JSON object of its name and arguments within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>\n"
    "A function's result comes back in <tool_response></tool_response> tags.")


class ToolError(ValueError):
    """Tools, a tool choice or tool messages that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def as_template_sees_it(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def template_style(template: str | None) -> tuple[str, bool]:
    """(the call format, whether the template itself shows the tools)."""
    if not template or not re.search(r"\btools\b", template):
        return "hermes", False
    if HERMES_OPEN in template:
        return "hermes", True
    if MISTRAL_OPEN in template:
        return "mistral", True
    if '"parameters"' in template or "<|python_tag|>" in template:
        return "llama3", True
    return "hermes", True


def _arguments_object(arguments, where: str):
    """OpenAI sends earlier calls' arguments as JSON text; templates want the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolError(f"{where}: arguments are not JSON") from None
    return arguments


def prepare(messages: list[dict], tools: list[Tool], template: str | None) -> tuple[list[dict], dict, str]:
    """(messages as the template gets them, extra template variables, the call format).
    `messages` are dicts with role, content and, for assistants, OpenAI's tool_calls."""
    style, native = template_style(template)
    if native:
        out = []
        for i, m in enumerate(messages):
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": _arguments_object(c["function"]["arguments"],
                                                                                f"messages.{i}.tool_calls")}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": [t.as_template_sees_it() for t in tools]} if tools else {}), style
    # the fallback: the tools in the system message, calls and results as text
    out: list[dict] = []
    if tools:
        spec = "\n".join(json.dumps(t.as_template_sees_it(), ensure_ascii=False) for t in tools)
        out.append({"role": "system", "content": FALLBACK_PROMPT.format(tools=spec)})
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments_object(
                c["function"]["arguments"], f"messages.{i}.tool_calls")}, ensure_ascii=False) + f"\n{HERMES_CLOSE}"
                      for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({"role": role, "content": content})
    return out, {}, "hermes"


def _call_schema(tool: Tool, key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: tool.parameters},
            "required": ["name", key], "additionalProperties": False}


def call_grammar(style: str, tools: list[Tool], parallel: bool, open_token: int | None = None) -> str:
    """A Lark grammar (llguidance's) for a reply that is only calls of these tools, in `style`.
    `open_token`: the id of the [TOOL_CALLS] control token, where the vocabulary has one."""
    key = "parameters" if style == "llama3" else "arguments"
    one = {"anyOf": [_call_schema(t, key) for t in tools], "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    if style == "hermes":
        more = ' ("\\n" call)*' if parallel else ""
        rule = (f"start: call{more}\n"
                f'call: "{HERMES_OPEN}\\n" obj "\\n{HERMES_CLOSE}"\n'
                f"obj: %json {json.dumps(one)}\n")
    elif style == "llama3":
        rule = f"start: obj\nobj: %json {json.dumps(one)}\n"
    else:
        many = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        opener = f"<[{open_token}]>" if open_token is not None else json.dumps(MISTRAL_OPEN)
        rule = f"start: {opener} obj\nobj: %json {json.dumps(many)}\n"
    return rule


def _call_from(obj, known: dict[str, Tool], key: str) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


class CallParser:
    """Separates a reply's calls from its text as the text arrives: `feed` returns the text that
    is surely not part of a call (to stream as content) and the calls completed so far;
    `finish` the rest. Text that may begin a call is held back until it is decided; what looked
    like a call but does not parse as one is given back as content."""

    def __init__(self, style: str, tools: list[Tool]):
        self.style, self.known = style, {t.name: t for t in tools}
        self.key = "parameters" if style == "llama3" else "arguments"
        self.buf = ""
        self.started = False  # for the JSON-first styles: the reply began like a call
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buf += text
        if self.style == "hermes":
            return self._hermes(final=False)
        if not self.started:
            head = self.buf.lstrip()
            if not head:
                return "", []
            opener = "{" if self.style == "llama3" else "["  # [TOOL_CALLS] too
            if head.startswith(opener) or "<|python_tag|>".startswith(head[:14]):  # the tag, or its start
                self.started = True
            else:  # a plain answer: stream it
                out, self.buf = self.buf, ""
                self.style = "text"
                return out, []
        if self.style == "text":
            out, self.buf = self.buf, ""
            return out, []
        return "", []

    def finish(self, text: str = "") -> tuple[str, list[Call]]:
        self.buf += text
        if self.style == "hermes":
            return self._hermes(final=True)
        if self.style == "text" or not self.buf.strip():
            out, self.buf = self.buf, ""
            return out, []
        body = self.buf.strip()
        for prefix in ("<|python_tag|>", MISTRAL_OPEN):
            body = body[len(prefix):].lstrip() if body.startswith(prefix) else body
        calls = self._parse_json(body)
        if calls is None:
            out, self.buf = self.buf, ""
            return out, []
        self.buf = ""
        self.calls += calls
        return "", calls

    def _parse_json(self, body: str) -> list[Call] | None:
        try:
            obj, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return None
        if body[end:].strip():
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from(o, self.known, self.key) for o in items]
        return calls if calls and all(calls) else None

    def _hermes(self, final: bool) -> tuple[str, list[Call]]:
        out, calls = [], []
        while True:
            i = self.buf.find(HERMES_OPEN)
            if i < 0:
                if final:
                    out.append(self.buf)
                    self.buf = ""
                else:  # hold back what could be the start of an opening tag
                    hold = next((k for k in range(min(len(HERMES_OPEN) - 1, len(self.buf)), 0, -1)
                                 if self.buf.endswith(HERMES_OPEN[:k])), 0)
                    out.append(self.buf[:len(self.buf) - hold])
                    self.buf = self.buf[len(self.buf) - hold:]
                break
            j = self.buf.find(HERMES_CLOSE, i)
            if j < 0 and not final:  # a call still arriving
                out.append(self.buf[:i])
                self.buf = self.buf[i:]
                break
            body = self.buf[i + len(HERMES_OPEN): j if j >= 0 else len(self.buf)]
            found = self._parse_json(body.strip())
            if found is None:  # not a call after all: it is text
                end = j + len(HERMES_CLOSE) if j >= 0 else len(self.buf)
                out.append(self.buf[:end])
            else:
                before = self.buf[:i]
                out.append("" if (self.calls or calls) and not before.strip() else before)  # blanks between calls
                calls += found
            self.buf = self.buf[j + len(HERMES_CLOSE):] if j >= 0 else ""
        self.calls += calls
        text = "".join(out)
        if self.calls and final:
            text = text.strip()
        elif self.calls and not text.strip():  # blanks between calls: content only if text follows
            self.buf, text = text + self.buf, ""
        return text, calls


def parse_tools(tools: list[dict] | None) -> list[Tool]:
    """OpenAI's `tools` (already shaped by the request schema) as Tool objects; names unique."""
    out, seen = [], set()
    for i, t in enumerate(tools or []):
        fn = t["function"]
        if fn["name"] in seen:
            raise ToolError(f"tools.{i}.function.name: {fn['name']!r} is given twice")
        seen.add(fn["name"])
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append(Tool(fn["name"], fn.get("description") or "", params))
    return out


def chosen(tools: list[Tool], choice) -> tuple[list[Tool], bool]:
    """(the tools the reply may call, whether it must call one) for a tool_choice."""
    if choice is None or choice == "auto":
        return tools, False
    if choice == "none":
        return [], False
    if choice == "required":
        if not tools:
            raise ToolError("tool_choice: 'required' needs tools")
        return tools, True
    name = choice["function"]["name"]
    named = [t for t in tools if t.name == name]
    if not named:
        raise ToolError(f"tool_choice: no tool is named {name!r}")
    return named, True
