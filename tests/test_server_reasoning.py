"""A reasoning model's thinking through a real server, with the official `openai` client: a tiny
model whose template is Qwen3's, with the generation prompt opening the thinking block
(tests/fixtures/reasoning_outputs.py: Qwen3-*-Thinking-2507 and DeepSeek-R1 do so), so its replies
start inside it and think until a budget closes it; served with --reasoning-budget BUDGET.
The thinking arrives in reasoning_content (whole and streamed), never in content; a budget of 0,
reasoning_effort "none" and enable_thinking false give none; a bigger budget thinks longer along
the same greedy path; a reply that opens its own block (forced here by a regex) is split too;
--reasoning-format none leaves it all in content. `sparseinfer chat` folds the thinking.
Recorded Qwen3 and gpt-oss outputs are split in tests/test_reasoning.py."""
from __future__ import annotations

import json

import openai
import pytest

from tests.fixtures.http_server import launched
from tests.fixtures.openai_server import run_cli
from tests.fixtures.reasoning_outputs import QWEN3_OPENS_THINKING
from tests.fixtures.tiny_gguf import write_tiny_llama

KEY = "reasoning-key-1"
BUDGET = 6
ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-thinking.gguf",
                            chat_template=QWEN3_OPENS_THINKING, ctx=2048)


@pytest.fixture(scope="module")
def client(thinking_model, tmp_path_factory):
    with launched(thinking_model, tmp_path_factory.mktemp("srv"), "--api-key", KEY, "--parallel", "2",
                  "--reasoning-budget", str(BUDGET)) as (_, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        c.model_id = c.models.list().data[0].id
        yield c


def _chat(client, max_tokens=24, **extra):
    r = client.chat.completions.create(model=client.model_id, messages=ASK, max_tokens=max_tokens, temperature=0,
                                       extra_body=extra)
    return r, (r.choices[0].message.model_extra or {}).get("reasoning_content")


def _streamed(client, max_tokens=24, **extra) -> tuple[list[tuple[str, str]], str]:
    chunks = client.chat.completions.create(model=client.model_id, messages=ASK, max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body=extra)
    parts, finish = [], None
    for c in chunks:
        d = c.choices[0].delta
        if (d.model_extra or {}).get("reasoning_content"):
            parts.append(("reasoning", d.model_extra["reasoning_content"]))
        if d.content:
            parts.append(("content", d.content))
        finish = c.choices[0].finish_reason or finish
    return parts, finish


def test_thinking_arrives_in_reasoning_content_never_in_content(client):
    r, thought = _chat(client)
    content = r.choices[0].message.content
    assert thought and content, (thought, content)  # the budget closed the block: an answer follows
    for marker in ("<think>", "</think>"):
        assert marker not in content and marker not in thought
    # streamed: the same parts, every thinking delta before the first answer delta
    parts, finish = _streamed(client)
    kinds = [k for k, _ in parts]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)
    assert "".join(t for k, t in parts if k == "reasoning") == thought
    assert "".join(t for k, t in parts if k == "content") == content
    assert finish == r.choices[0].finish_reason
    # left in content, as the model wrote it, when the request asks for no parsing
    raw = _chat(client, reasoning_format="none")
    assert raw[1] is None
    text = raw[0].choices[0].message.content
    assert "</think>" in text and text.split("</think>")[0].strip() == thought
    assert text.split("</think>", 1)[1].lstrip() == content


def test_the_budget_bounds_the_thinking_along_the_same_greedy_path(client):
    short, long_ = _chat(client, reasoning_budget=2)[1], _chat(client, reasoning_budget=12, max_tokens=30)[1]
    default = _chat(client)[1]  # the server's --reasoning-budget
    assert short and long_.startswith(short) and default.startswith(short) and long_.startswith(default)
    assert len(short) < len(long_)
    # an effort level is a budget too; without a bound the block never closes here: all thinking
    assert _chat(client, reasoning_effort="low", max_tokens=12)[0].choices[0].message.content == ""
    unbounded, thought = _chat(client, reasoning_budget=-1, max_tokens=16)
    assert unbounded.choices[0].message.content == "" and thought and unbounded.choices[0].finish_reason == "length"


def test_no_thinking_for_a_budget_of_0_effort_none_or_enable_thinking_false(client):
    default = _chat(client)[0]
    off = [_chat(client, reasoning_budget=0), _chat(client, reasoning_effort="none"),
           _chat(client, chat_template_kwargs={"enable_thinking": False})]
    for r, thought in off:
        assert thought is None and r.choices[0].message.content
        assert "</think>" not in r.choices[0].message.content
    # the template was told: it wrote the empty, closed block into the prompt
    assert {r.usage.prompt_tokens for r, _ in off} == {off[0][0].usage.prompt_tokens}
    assert off[0][0].usage.prompt_tokens > default.usage.prompt_tokens
    assert len({r.choices[0].message.content for r, _ in off}) == 1
    parts, _ = _streamed(client, reasoning_budget=0)
    assert parts and all(k == "content" for k, _ in parts)


def test_a_reply_that_opens_its_own_block_is_split_too(client):
    """Qwen3's published template leaves the opening to the model: a regex makes this one write it."""
    regex = r"<think>\n[a-z ]{4,20}\n</think>\n\n[a-z]{1,12}"
    r, thought = _chat(client, max_tokens=60, regex=regex)
    content = r.choices[0].message.content
    assert thought and content and "<think>" not in content and "</think>" not in content
    assert thought.strip() == thought and set(thought) <= set("abcdefghijklmnopqrstuvwxyz ")
    parts, _ = _streamed(client, max_tokens=60, regex=regex)
    assert "".join(t for k, t in parts if k == "reasoning") == thought


def test_a_response_format_is_the_answer_with_no_thinking_before_it(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r, thought = _chat(client, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
    assert thought is None and r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"ok"}


def test_bad_reasoning_fields_are_400s(client):
    for extra, param in [({"reasoning_effort": "huge"}, "reasoning_effort"), ({"reasoning_budget": -2}, "reasoning_budget"),
                         ({"reasoning_format": "deep"}, "reasoning_format"),
                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs")]:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, **extra)
        assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body


def test_the_terminal_chat_folds_the_thinking(thinking_model):
    r = run_cli(["chat", "-m", str(thinking_model), "-t", "2", "--cpu-workers", "1", "-n", "8", "--temperature", "0"],
                input="hello\n/thinking\nhello\n/exit\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    # folded: one line counting the thought's words (the tiny model thinks through all 8 tokens)
    assert lines[0].startswith("(thought for ") and lines[0].endswith(" words; /thinking shows it)"), lines
    # shown: the thought itself, marked
    assert any(line.startswith("thinking: ") and len(line) > len("thinking: ") for line in lines[1:]), lines
    assert "thinking shown" in r.stderr
