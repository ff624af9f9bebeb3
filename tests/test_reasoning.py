"""A reasoning model's thinking apart from its answer, without a server: recorded outputs of
Qwen3, DeepSeek-R1 and gpt-oss (tests/fixtures/reasoning_outputs.py) split into thinking,
answer and tool calls however their text is cut into pieces; the family told by the template;
the request's options (budget, effort, enable_thinking, chat_template_kwargs); and the budget
held while decoding (ThinkingBudget forces the closing marker's tokens once the budget is spent,
then lets the answer's grammar take over). Through real servers: tests/test_server_apis.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from coordinator.serve.api_schema import ChatRequest
from coordinator.serve.reasoning import (HarmonySplitter, ReplySplitter, ThinkSplitter, family_of, splitter_for)
from coordinator.serve.state import ApiError
from coordinator.serve.thinking import (EFFORT_BUDGETS, THINK_CLOSING, ReasoningDefaults, Thinking,
                                        ThinkingBudget)
from coordinator.serve.tool_calls import CallParser, Tool
from coordinator.text.chat_template import CHATML_TEMPLATE
from coordinator.text.tokenizer import GGUFTokenizer
from sparsecore.gguf_file import open_gguf
from tests.fixtures.reasoning_outputs import (HARMONY_REPLIES, HARMONY_TEMPLATE,
                                              QWEN3_REPLIES, QWEN3_THINKING, R1_REPLY)

TOOLS = [Tool("get_weather", "", {"type": "object"}), Tool("get_time", "", {"type": "object"})]
NAMES = {t.name for t in TOOLS}


def _split(make, text: str, size: int) -> tuple[str, str, list]:
    """Feed `text` in pieces of `size` characters to a fresh splitter, then finish."""
    sp = make()
    thought, answer, calls = [], [], []
    for i in range(0, len(text), size):
        t, a, c = sp.feed(text[i:i + size])
        thought.append(t), answer.append(a), calls.extend(c)
    t, a, c = sp.feed("", final=True)
    thought.append(t), answer.append(a), calls.extend(c)
    return "".join(thought), "".join(answer), [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
@pytest.mark.parametrize("case", range(len(QWEN3_REPLIES)))
def test_qwen3_replies_split_into_thinking_answer_and_calls(case, size):
    raw, thought, answer, calls = QWEN3_REPLIES[case]
    got = _split(lambda: ReplySplitter(ThinkSplitter(), CallParser("hermes", TOOLS)), raw, size)
    assert got == (thought, answer, calls)
    assert "<think>" not in got[1] and "</think>" not in got[1]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_block_the_prompt_opened_is_thinking_from_the_first_token(size):
    raw, thought, answer = R1_REPLY
    assert _split(lambda: ReplySplitter(ThinkSplitter(opened=True), None), raw, size) == (thought, answer, [])
    # cut by max_tokens before the block closed: all of it is thinking, nothing leaks into the answer
    assert _split(lambda: ReplySplitter(ThinkSplitter(opened=True), None), "still thinking </thi", size) == \
        ("still thinking </thi", "", [])


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("case", range(len(HARMONY_REPLIES)))
def test_gpt_oss_harmony_replies_split_into_reasoning_content_and_calls(case, size):
    raw, thought, answer, calls = HARMONY_REPLIES[case]
    got = _split(lambda: HarmonySplitter("<|start|>assistant", NAMES), raw, size)
    assert got == (thought, answer, calls)
    assert "<|" not in got[0] + got[1]


def test_harmony_call_of_a_tool_not_offered_is_text_and_a_forced_final_message_is_the_answer():
    raw = HARMONY_REPLIES[1][0]
    thought, answer, calls = _split(lambda: HarmonySplitter("<|start|>assistant", set()), raw, 4)
    assert calls == [] and json.loads(answer) == {"city": "Tokyo", "unit": "celsius"}
    # the prompt may write the final message's header itself: the reply is all answer
    tail = "<|start|>assistant<|channel|>final<|message|>"
    assert _split(lambda: HarmonySplitter(tail, NAMES), "Plain answer.", 3) == ("", "Plain answer.", [])


def test_the_family_and_the_opened_block_come_from_the_template_and_the_prompt():
    assert family_of(HARMONY_TEMPLATE) == "harmony"
    assert family_of(QWEN3_THINKING) == family_of(CHATML_TEMPLATE) == family_of(None) == "think"
    assert isinstance(splitter_for("harmony", "<|start|>assistant"), HarmonySplitter)
    opened = splitter_for("think", "<|im_start|>assistant\n<think>\n")
    assert opened.feed("a thought", final=True) == ("a thought", "")
    closed = splitter_for("think", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed.feed("an answer", final=True) == ("", "an answer")


def _thinking(fmt="auto", budget=-1, template=QWEN3_THINKING, constrained=False, **body) -> Thinking:
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    return Thinking.of(ReasoningDefaults(fmt, budget), template, req, constrained)


def test_request_options_give_budgets_and_template_variables():
    assert _thinking().budget is None and _thinking().template_vars == {}
    assert _thinking(budget=100).budget == 100  # --reasoning-budget
    assert _thinking(budget=100, reasoning_budget=7).budget == 7  # the request's own
    assert _thinking(budget=100, reasoning_budget=-1).budget is None
    for effort, tokens in EFFORT_BUDGETS.items():
        assert _thinking(reasoning_effort=effort).budget == tokens
    # no thinking: the template is asked for none, and a block it opens anyway closes at once
    assert _thinking(reasoning_budget=0).template_vars == {"enable_thinking": False}
    off = _thinking(chat_template_kwargs={"enable_thinking": False, "custom": 1})
    assert off.budget == 0 and off.template_vars == {"enable_thinking": False, "custom": 1}
    # a grammar constrains the answer: no thinking before it
    assert _thinking(constrained=True).budget == 0
    # gpt-oss's template takes the effort itself
    assert _thinking(template=HARMONY_TEMPLATE, reasoning_effort="high").template_vars == {"reasoning_effort": "high"}
    assert not _thinking(fmt="none").parse and _thinking(fmt="none", reasoning_format="auto").parse
    with pytest.raises(ApiError, match="chat_template_kwargs: 'messages'"):
        _thinking(chat_template_kwargs={"messages": []})


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return GGUFTokenizer.from_reader(open_gguf(tiny_model))


def _decode_with(constraint, tokenizer, steps: int, seed: int = 0) -> list[int]:
    """Greedy over random logits through `constraint`, as the scheduler's sampler uses it."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        logits = constraint.restrict(rng.standard_normal(tokenizer.vocab_size).astype(np.float32))
        tok = int(np.argmax(logits))
        constraint.accept(tok)
        out.append(tok)
    return out


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_the_budget_closes_an_opened_block_after_that_many_tokens(tokenizer, budget):
    closing = tokenizer.encode(THINK_CLOSING, add_bos=False, add_eos=False)
    got = _decode_with(ThinkingBudget(tokenizer, "think", True, budget, closing), tokenizer, budget + len(closing) + 6)
    assert got[budget:budget + len(closing)] == closing
    text = tokenizer.decode(got)
    assert text.count("</think>") == 1 and ThinkSplitter(opened=True).feed(text, final=True)[1]


def test_the_budget_counts_from_the_opening_the_model_writes(tokenizer):
    """Not opened by the prompt: nothing is forced until the reply opens a block itself."""
    opening = tokenizer.encode("<think>", add_bos=False, add_eos=False)
    closing = tokenizer.encode(THINK_CLOSING, add_bos=False, add_eos=False)
    free = ThinkingBudget(tokenizer, "think", False, 2, closing)
    assert "</think>" not in tokenizer.decode(_decode_with(free, tokenizer, 30))
    budget = ThinkingBudget(tokenizer, "think", False, 2, closing)
    for tok in opening:
        budget.accept(tok)
    got = _decode_with(budget, tokenizer, 2 + len(closing))
    assert got[2:] == closing


def test_after_the_closing_the_grammar_constrains_the_answer(tokenizer):
    from coordinator.text.structured_output import Constraint, TokenTable, grammar_for

    closing = tokenizer.encode(THINK_CLOSING, add_bos=False, add_eos=False)
    inner = Constraint(TokenTable.of(tokenizer, tokenizer.vocab_size), grammar_for(regex="yes|no"))
    budget = ThinkingBudget(tokenizer, "think", True, 0, closing, inner)
    got = []
    while not budget.complete and len(got) < 40:
        got += _decode_with(budget, tokenizer, 1, seed=len(got))
    assert tokenizer.decode(got).split("</think>\n\n")[1] in ("yes", "no")


def test_an_ignore_eos_request_never_ends_at_eos_inside_the_budget(tokenizer):
    eos = sorted(tokenizer.eos_ids)
    budget = ThinkingBudget(tokenizer, "think", True, 100, [1], banned=eos)
    logits = np.zeros(tokenizer.vocab_size, dtype=np.float32)
    logits[eos] = 100.0
    assert not np.isfinite(budget.restrict(logits)[eos]).any()
