"""Tool calls: tools rendered by real model templates (a Qwen 3 template, Llama 3.1's) and by the
fallback, calls found in replies as they stream, the grammar that makes a required call parse
(walked on random logits), and the whole exchange through the official `openai` client against
real servers: SmolLM2 and Gemma 3 (fallback format) and a tiny model carrying the Qwen template.
The templates in fixtures/chat_templates are the models' published ones (tokenizer_config.json's
chat_template of meta-llama/Llama-3.1-8B-Instruct, and of a Qwen 3 model), kept as data."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest

from coordinator.text.chat_template import CHATML_TEMPLATE, render_chat
from coordinator.text.structured_output import Constraint, TokenTable, grammar_for
from coordinator.text.tokenizer import GGUFTokenizer
from coordinator.serve.tool_calls import CallParser, Tool, call_grammar, parse_tools, prepare, template_style
from sparsecore.gguf_file import open_gguf
from tests.fixtures.http_server import launched
from tests.fixtures.tiny_gguf import write_tiny_llama

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
LLAMA31 = (TEMPLATES / "llama-3.1-instruct.jinja").read_text()

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]},
                                         "precise": {"type": "boolean"}},
        "required": ["zone", "precise"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tools() -> list[Tool]:
    return parse_tools(TOOLS)


def _history(arguments='{"city": "Paris", "unit": "celsius"}'):
    return ASK + [{"role": "assistant", "content": "",
                   "tool_calls": [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": arguments}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'}]


# ---- rendering ----------------------------------------------------------------------------

def test_each_template_gets_its_own_style():
    assert template_style(QWEN3) == ("hermes", True)
    assert template_style(LLAMA31) == ("llama3", True)
    assert template_style(CHATML_TEMPLATE) == ("hermes", False)  # SmolLM2's: no tools, the fallback
    assert template_style(None) == ("hermes", False)


def test_qwen_template_shows_the_tools_and_the_exchange():
    messages, variables, style = prepare(_history(), _tools(), QWEN3)
    text = render_chat(QWEN3, messages, **variables)
    assert style == "hermes"
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in text  # the tools as Qwen was trained to see them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama_template_shows_the_tools_and_the_exchange():
    messages, variables, style = prepare(_history(), _tools(), LLAMA31)
    text = render_chat(LLAMA31, messages, bos_token="<|begin_of_text|>", **variables)
    assert style == "llama3"
    assert "Given the following functions" in text and '"name": "get_time"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temperature\\": 18}"' in text or \
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 18}' in text


def test_fallback_describes_the_tools_and_turns_results_into_user_turns():
    messages, variables, style = prepare(_history() + [{"role": "user", "content": "And now?"}], _tools(), CHATML_TEMPLATE)
    assert variables == {} and style == "hermes"
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"] and "get_time" in messages[0]["content"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]  # the result and "And now?" merged
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    assert messages[3]["content"] == '<tool_response>\n{"temperature": 18}\n</tool_response>\n\nAnd now?'
    text = render_chat(CHATML_TEMPLATE, messages)
    assert text.count("<|im_start|>") == 5


def test_arguments_that_are_not_json_are_named():
    with pytest.raises(ValueError, match=r"messages\.1\.tool_calls: arguments are not JSON"):
        prepare(_history(arguments="{city: Paris"), _tools(), QWEN3)


# ---- finding calls in a reply -------------------------------------------------------------

def _stream(parser: CallParser, pieces: list[str]):
    text, calls = [], []
    for p in pieces:
        t, c = parser.feed(p)
        text.append(t)
        calls += c
    t, c = parser.finish()
    return "".join(text) + t, calls + c


def test_hermes_calls_are_split_from_text_as_they_stream():
    reply = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n' \
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "precise": false}}\n</tool_call>'
    for size in (1, 3, 7, len(reply)):
        parser = CallParser("hermes", _tools())
        sent = []
        for i in range(0, len(reply), size):
            t, _ = parser.feed(reply[i:i + size])
            sent.append(t)
            assert "<" not in "".join(sent)  # nothing of a call leaks into the content
        text, calls = _stream(parser, [])
        assert "".join(sent) + text == "Let me look. "
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
            ("get_weather", {"city": "Rome", "unit": "celsius"}), ("get_time", {"zone": "CET", "precise": False})]


def test_what_is_not_a_call_stays_text():
    for reply in ("<tool_call>not json</tool_call> ok", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
                  "1 < 2 and <tool_ is not a tag"):
        text, calls = _stream(CallParser("hermes", _tools()), [reply[:5], reply[5:]])
        assert calls == [] and text == reply


def test_llama_and_mistral_calls():
    text, calls = _stream(CallParser("llama3", _tools()), ['{"name": "get_time", ', '"parameters": {"zone": "UTC", "precise": true}}'])
    assert text == "" and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "UTC", "precise": True}
    text, calls = _stream(CallParser("llama3", _tools()), ["It is ", "sunny."])
    assert text == "It is sunny." and calls == []
    text, calls = _stream(CallParser("mistral", _tools()), ['[{"name": "get_time", "arguments": {"zone": "PST", "precise": false}},',
                                                            ' {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'])
    assert text == "" and [c.name for c in calls] == ["get_time", "get_weather"]


# ---- the grammar of a required call -------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokens(tiny_model):
    tk = GGUFTokenizer.from_reader(open_gguf(tiny_model))
    return tk, TokenTable.of(tk, tk.vocab_size)


@pytest.mark.parametrize("style", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("seed", range(3))
def test_a_required_call_always_parses(tiny_tokens, style, seed):
    """Random logits, so the grammar alone decides what is valid: whatever it lets through
    parses as calls of the offered tools with arguments valid against their schemas."""
    tk, table = tiny_tokens
    c = Constraint(table, grammar_for(grammar=call_grammar(style, _tools(), parallel=seed == 0)))
    rng = np.random.default_rng(seed)
    ids = []
    for _ in range(400):
        if c.complete:
            break
        logits = c.restrict(rng.standard_normal(table.n_vocab).astype(np.float32) * 3)
        tok = int(np.argmax(logits))
        if tok in tk.eos_ids:
            break
        c.accept(tok)
        ids.append(tok)
    else:
        pytest.skip("random walk did not end within 400 tokens")  # the schemas bound every string: not expected
    text, calls = _stream(CallParser(style, _tools()), [tk.decode(ids)])
    assert calls and not text.strip(), tk.decode(ids)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ---- through the client -------------------------------------------------------------------

@pytest.fixture(scope="module", params=["smollm2", "gemma3", "tiny-qwen3"])
def served(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    if request.param == "tiny-qwen3":
        path = write_tiny_llama(tmp / "tiny-qwen3.gguf", chat_template=QWEN3, ctx=2048)
    else:
        path = request.getfixturevalue("smollm2_path" if request.param == "smollm2" else "gemma3_path")
    with launched(path, tmp, "--parallel", "4") as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield client, client.models.list().data[0].id


def _ask(client, model, messages, stream=False, **kw):
    args = dict(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=150)
    args.update(kw)
    if not stream:
        r = client.chat.completions.create(**args)
        c = r.choices[0]
        return c.message.content, [(t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []], \
            c.finish_reason
    text, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        c = chunk.choices[0]
        text.append(c.delta.content or "")
        for t in c.delta.tool_calls or []:
            calls.setdefault(t.index, [t.id, t.function.name, ""])
            calls[t.index][2] += t.function.arguments or ""
        finish = c.finish_reason or finish
    return "".join(text) or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_call_returns_tool_calls_whose_arguments_validate(served, stream):
    client, model = served
    content, calls, finish = _ask(client, model, ASK, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and content is None and len(calls) == 1
    cid, name, arguments = calls[0]
    assert cid.startswith("call_") and name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_function_is_the_one_called(served):
    client, model = served
    content, calls, finish = _ask(client, model, ASK, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                  parallel_tool_calls=False)
    assert finish == "tool_calls" and [c[1] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0][2]), TIME)


def test_a_two_turn_exchange(served):
    """Call, the tool's result as a `tool` message, then the answer, all through the client."""
    client, model = served
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=150)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=40)
    reply = second.choices[0]
    assert reply.message.tool_calls is None and reply.message.content and reply.finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_auto_leaves_the_model_free(served):
    client, model = served
    content, calls, finish = _ask(client, model, [{"role": "user", "content": "Say hello."}], max_tokens=20)
    assert finish in ("stop", "length", "tool_calls")
    for _, name, arguments in calls:  # whatever it chose, what it returns as a call parses
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert content or calls


@pytest.mark.parametrize("kw, param, says", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools.2.function.name", "twice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}], tool_choice="required"),
     "tools", "foo"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "both"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name", ""),
])
def test_unusable_tools_are_400_naming_the_field(served, kw, param, says):
    client, model = served
    args = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    err = e.value.body
    assert err["param"] == param and says in err["message"], err
