"""A chat request's thinking: whether it is parsed out of the answer (--reasoning-format, or the
request's reasoning_format), how many tokens it may take (--reasoning-budget, the request's
reasoning_budget or reasoning_effort), what the template is told (chat_template_kwargs,
enable_thinking, reasoning_effort), and `ThinkingBudget`, which holds the thinking to its budget
while decoding: once the budget is spent it makes the next tokens the closing marker, so the
model goes on to its answer.

A budget of 0 asks the template for no thinking (enable_thinking false: Qwen3 then writes an
empty, closed block itself) and closes at once a block the prompt opened anyway. A grammar
(response_format, json_schema, a required tool call) constrains the answer: such a request does
not think (budget 0), and the grammar applies from the first token after the closed block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import reasoning
from .state import ApiError

# reasoning_effort as token budgets: OpenAI's levels, sized for a local model's thinking (a
# Qwen3 answer to a short question thinks for some hundreds of tokens)
EFFORT_BUDGETS = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": 4096}
# what renders need and a request may not replace
_RESERVED = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
THINK_CLOSING = "\n" + reasoning.THINK_CLOSE + "\n\n"
HARMONY_CLOSING = (reasoning.H_END + reasoning.H_START + "assistant" + reasoning.H_CHANNEL + "final"
                   + reasoning.H_MESSAGE)


@dataclass
class ReasoningDefaults:
    """The server's options: `fmt` "auto" (thinking apart) or "none" (left in content);
    `budget` -1 for none."""
    fmt: str = "auto"
    budget: int = -1


@dataclass
class Thinking:
    """One chat request's thinking: its family, whether it is parsed, its budget (None: no
    bound), the template variables it sets, and (after the prompt is made) whether the prompt
    opened the block and the prompt's tail (harmony's header may begin there)."""
    family: str
    parse: bool
    budget: int | None
    template_vars: dict = field(default_factory=dict)
    opened: bool = False
    prompt_tail: str = ""

    @classmethod
    def of(cls, defaults: ReasoningDefaults, template: str | None, body, constrained: bool) -> "Thinking":
        family = reasoning.family_of(template)
        fmt = body.reasoning_format or defaults.fmt
        budget = defaults.budget if defaults.budget >= 0 else None
        kwargs = dict(body.chat_template_kwargs or {})
        bad = sorted(_RESERVED & kwargs.keys())
        if bad:
            raise ApiError(400, f"chat_template_kwargs: {bad[0]!r} is set by the server", param="chat_template_kwargs")
        if body.reasoning_effort is not None:
            budget = EFFORT_BUDGETS[body.reasoning_effort]
            if family == "harmony" and body.reasoning_effort in ("low", "medium", "high"):
                kwargs.setdefault("reasoning_effort", body.reasoning_effort)  # gpt-oss's system message says it
        if body.reasoning_budget is not None:
            budget = body.reasoning_budget if body.reasoning_budget >= 0 else None
        if constrained:
            budget = 0
        if budget == 0 and family == "think":
            kwargs.setdefault("enable_thinking", False)
        if kwargs.get("enable_thinking") is False and family == "think":
            budget = 0  # a block the prompt opens anyway closes at once
        return cls(family, fmt != "none", budget, kwargs)

    def after_prompt(self, tokenizer, ids: list[int]) -> None:
        """Read the prompt's end: did it open a thinking block, or begin a harmony header?"""
        tail = tokenizer.decode(ids[-24:])
        self.prompt_tail = tail
        if self.family == "think":
            self.opened = tail.rstrip().endswith(reasoning.THINK_OPEN)

    @property
    def keep_special(self) -> bool:
        """Harmony's markers stay in the text: parsed, or left as written (reasoning format none)."""
        return self.family == "harmony"

    def splitter(self, tool_names: set[str]):
        return reasoning.splitter_for(self.family, self.prompt_tail, tool_names) if self.parse else None

    def constraint(self, tokenizer, inner, ignore_eos: bool):
        """The request's Constraint: `inner` (its grammar, or None), wrapped in a ThinkingBudget
        where the thinking has a bound to keep."""
        if self.budget is None or (inner is not None and not self.opened):
            return inner  # unbounded; or a grammar that decides from the first token
        closing = THINK_CLOSING if self.family == "think" else HARMONY_CLOSING
        return ThinkingBudget(tokenizer, self.family, self.opened, self.budget,
                              tokenizer.encode(closing, add_bos=False, add_eos=False), inner,
                              tokenizer.eos_ids if ignore_eos and inner is None else ())


class ThinkingBudget:
    """A Constraint (structured_output's interface: restrict, accept, complete) that counts the
    tokens decoded inside the thinking and, at `budget`, allows only the `closing` tokens, one
    by one; `inner` (a grammar) then constrains the answer. `banned`: tokens never allowed
    (the EOS ids of an ignore_eos request: sampling ends at an EOS wherever a constraint is)."""

    def __init__(self, tokenizer, family: str, opened: bool, budget: int, closing: list[int], inner=None,
                 banned=()):
        self.tk, self.family, self.budget, self.closing, self.inner = tokenizer, family, budget, closing, inner
        self.banned = np.fromiter(banned, dtype=np.int64)
        self.state = "think" if opened else "start"  # start: the reply may yet open a block
        self.text = ""  # the reply's recent text (markers are looked for in it)
        self.spent = 0  # tokens decoded inside the thinking
        self.forced: list[int] = []
        self.closed = False  # the closing was forced: the inner grammar starts after it

    def _piece(self, tok: int) -> str:
        if self.tk.is_special(tok):
            return self.tk.tokens[tok]
        return self.tk.piece_bytes(tok).decode("utf-8", "replace")

    def restrict(self, logits: np.ndarray) -> np.ndarray:
        if not self.forced and self.state == "think" and self.spent >= self.budget and not self.closed:
            self.forced = list(self.closing)
        if self.forced:
            out = np.full(len(logits), -np.inf, dtype=np.float32)
            out[self.forced[0]] = 0.0
            return out
        if self.inner is not None and self.closed:
            return self.inner.restrict(logits)
        if len(self.banned):
            logits = logits.copy()
            logits[self.banned[self.banned < len(logits)]] = -np.inf
        return logits

    def accept(self, token: int) -> None:
        if self.forced:
            self.forced.pop(0)
            if not self.forced:
                self.closed, self.state, self.text = True, "answer", ""
            return
        if self.inner is not None and self.closed:
            self.inner.accept(token)
            return
        if self.state == "answer":
            return
        self.text = (self.text + self._piece(token))[-64:]
        if self.state == "think":
            self.spent += 1
            if self._closed_by_model():
                self.state = "answer"
        elif self.family == "think":
            head = self.text.lstrip()
            if head.startswith(reasoning.THINK_OPEN):
                self.state, self.text = "think", head[len(reasoning.THINK_OPEN):]
            elif not reasoning.THINK_OPEN.startswith(head):
                self.state = "answer"
        elif reasoning.H_MESSAGE in self.text:  # harmony: a message began; analysis is thinking
            header = self.text.split(reasoning.H_MESSAGE)[0]
            analysis = reasoning.H_CHANNEL + "analysis" in header and "to=" not in header
            self.state, self.text = ("think" if analysis else "answer"), ""

    def _closed_by_model(self) -> bool:
        if self.family == "think":
            return reasoning.THINK_CLOSE in self.text
        return reasoning.H_END in self.text  # harmony: the analysis message ended

    @property
    def complete(self) -> bool:
        return self.inner is not None and self.closed and self.inner.complete
