"""A chat request's tools as the server uses them (tool_calls.py does the formats): the
messages and template variables the prompt gets, the grammar a required call needs, and the
parser of the calls in the reply."""
from __future__ import annotations

from . import tool_calls
from .state import ApiError, ServerState


def _control_token(tk, text: str) -> int | None:
    """The id of the control token spelled `text` (a grammar names it by id), or None."""
    i = tk.token_id(text)
    return i if i is not None and tk.is_special(i) else None


def _choice(choice):
    return choice.model_dump() if hasattr(choice, "model_dump") else choice


class ToolUse:
    """A chat request's tools: the messages and variables its template gets, the grammar a
    required call needs, and a parser of the calls in the reply (coordinator/serve/tool_calls.py)."""

    def __init__(self, messages: list[dict], template_vars: dict, style: str, tools: list, grammar: str | None):
        self.messages, self.template_vars, self.style, self.tools, self.grammar = \
            messages, template_vars, style, tools, grammar

    @classmethod
    def of(cls, state: ServerState, body, messages: list[dict]) -> "ToolUse":
        history = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if not body.tools and not history:
            return cls(messages, {}, "hermes", [], None)
        try:
            every = tool_calls.parse_tools([t.model_dump() for t in body.tools or []])
            offered, must = tool_calls.chosen(every, _choice(body.tool_choice) if body.tools else "none")
            # every tool is shown whatever the choice: the prompt stays the same from turn to turn,
            # so the next turn reuses its KV cache; the choice decides what is parsed or required
            shaped, variables, style = tool_calls.prepare(messages, every, state.engine.chat_template)
            grammar = None
            if must:
                opener = _control_token(state.engine.tokenizer, tool_calls.MISTRAL_OPEN) if style == "mistral" else None
                grammar = tool_calls.call_grammar(style, offered, body.parallel_tool_calls, opener)
        except tool_calls.ToolError as e:
            raise ApiError(400, str(e), param=str(e).split(":")[0]) from None
        return cls(shaped, variables, style, offered, grammar)

    def parser(self) -> "tool_calls.CallParser | None":
        return tool_calls.CallParser(self.style, self.tools) if self.tools else None
