"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) and OpenAI's Responses
API (POST /v1/responses), driven by the official `anthropic` and `openai` clients against real
servers: SmolLM2, and a tiny model with a Qwen3 template whose prompt opens the thinking block
(served with --reasoning-budget, so its replies think, then answer). Each API's reply is the
chat completion's for the same conversation (the same machinery, greedy), in its own shape;
streams come as that API's events in their order; a tool round trip and a JSON schema go
through each; bad bodies get 400s in each API's own error shape."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from tests.fixtures.http_server import launched
from tests.fixtures.reasoning_outputs import QWEN3_OPENS_THINKING
from tests.fixtures.tiny_gguf import write_tiny_llama

KEY = "apis-key-1"
SYSTEM = "Answer in one short sentence."
ASK = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
GREEDY = {"temperature": 0}  # the anthropic client no longer has sampling arguments: sent as older clients do
COLOR = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
         "required": ["color"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["smollm2", "tiny-qwen3"])
def served(request, tmp_path_factory):
    """(url, model id, whether its replies think) of a server; one at a time (module scope, by param)."""
    if request.param == "smollm2":
        model, extra = request.getfixturevalue("smollm2_path"), ()
    else:
        model = write_tiny_llama(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-thinking.gguf",
                                 chat_template=QWEN3_OPENS_THINKING, ctx=2048)
        extra = ("--reasoning-budget", "6")
    with launched(model, tmp_path_factory.mktemp("srv"), "--api-key", KEY, "--parallel", "2", *extra) as (_, url):
        yield url, model.name.removesuffix(".gguf"), request.param != "smollm2"


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0, timeout=180)


def _chat(oai, model, max_tokens, **kw):
    r = oai.chat.completions.create(model=model, messages=[{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": ASK}],
                                    max_tokens=max_tokens, temperature=0, **kw)
    return r, (r.choices[0].message.model_extra or {}).get("reasoning_content") or ""


def _sse(url: str, path: str, body: dict) -> list[tuple[str, dict]]:
    """A stream's (event name, data) pairs, read raw (the clients hide pings and names)."""
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "x-api-key": KEY})
    out, name = [], None
    with urllib.request.urlopen(req, timeout=180) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


def _post(url: str, path: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {KEY}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- Anthropic's Messages API ----------------------------------------------------------------

def test_a_message_is_the_chat_completion_in_anthropic_shape(served, oai, claude):
    _, model, thinks = served
    chat, thought = _chat(oai, model, 16)
    m = claude.messages.create(model=model, max_tokens=16, system=SYSTEM, extra_body=GREEDY,
                               messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == model
    kinds = [b.type for b in m.content]
    assert kinds == (["thinking"] if thinks else []) + ["text"]
    assert "".join(b.thinking for b in m.content if b.type == "thinking") == thought and bool(thought) == thinks
    assert "".join(b.text for b in m.content if b.type == "text") == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    counted = claude.messages.count_tokens(model=model, system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == m.usage.input_tokens


def test_a_stream_is_anthropics_events_in_their_order(served, claude):
    url, model, thinks = served
    body = {"model": model, "max_tokens": 16, "system": SYSTEM, "messages": [{"role": "user", "content": ASK}]}
    events = _sse(url, "/v1/messages", {**body, **GREEDY})
    names = [n for n, _ in events]
    assert all(d["type"] == n for n, d in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["usage"]["input_tokens"] > 0
    blocks = [n for n in names if n != "ping"][1:-2]
    index = -1
    for (n, d), prev in zip([(n, d) for n, d in events if n in ("content_block_start", "content_block_delta",
                                                                  "content_block_stop")], [None] + blocks):
        if n == "content_block_start":
            assert prev in (None, "content_block_stop") and d["index"] == index + 1
            index = d["index"]
        else:
            assert d["index"] == index
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == (["thinking"] if thinks else []) + ["text"]
    # the client accumulates the same message as the one not streamed
    whole = claude.messages.create(**body, extra_body=GREEDY)
    with claude.messages.stream(**body, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_stop_sequences_end_the_message_and_are_reported(served, claude):
    _, model, _ = served
    ask = dict(model=model, extra_body=GREEDY, system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    free = claude.messages.create(max_tokens=24, **ask)
    text = "".join(b.text for b in free.content if b.type == "text")
    raw = "".join(getattr(b, "thinking", "") for b in free.content) + text  # the stop applies to both
    stop = next(text[i:i + 3] for i in range(2, len(text) - 3) if raw.find(text[i:i + 3]) == len(raw) - len(text) + i
                and text[i:i + 3].strip())
    m = claude.messages.create(max_tokens=24, stop_sequences=[stop], **ask)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in m.content if b.type == "text") == text[:text.index(stop)]


def test_a_tool_round_trip(served, claude):
    url, model, _ = served
    tools = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(model=model, max_tokens=120, extra_body=GREEDY, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=ask)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(model=model, max_tokens=120, extra_body=GREEDY, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=ask) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    # the result goes back as a tool_result block and reaches the prompt
    turn = ask + [{"role": "assistant", "content": m.content}]

    def result(text):
        return turn + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": text}]}]
    answer = claude.messages.create(model=model, max_tokens=8, extra_body=GREEDY, tools=tools, messages=result("18 C"))
    assert answer.type == "message" and answer.usage.output_tokens >= 1
    with_result = claude.messages.count_tokens(model=model, tools=tools, messages=result("18 degrees and sunny"))
    empty = claude.messages.count_tokens(model=model, tools=tools, messages=result(""))
    assert with_result.input_tokens - empty.input_tokens >= 4


def test_output_config_format_is_structured_output(served, claude):
    _, model, _ = served
    m = claude.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=[{"role": "user", "content":
                               "Pick a color."}], output_config={"format": {"type": "json_schema", "schema": COLOR}})
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]  # no thinking before a format
    jsonschema.validate(json.loads(m.content[0].text), COLOR)


def test_bad_bodies_get_anthropics_error_shape(served, claude):
    url, model, _ = served
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": model, "messages": user}, 400, "max_tokens"),
        ({"model": model, "max_tokens": 0, "messages": user}, 400, "max_tokens"),
        ({"model": model, "max_tokens": 8, "messages": []}, 400, "messages"),
        ({"model": model, "max_tokens": 8, "temperature": 1.5, "messages": user}, 400, "temperature"),
        ({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, 400, "image"),
        ({"model": model, "max_tokens": 8, "messages": user + [{"role": "assistant", "content": "Sure"}]}, 400,
         "prefill"),
        ({"model": model, "max_tokens": 8, "messages": user, "tool_choice": {"type": "tool"}}, 400, "tool_choice"),
        ({"model": "claude-nonexistent", "max_tokens": 8, "messages": user}, 404, "claude-nonexistent"),
    ]
    for body, status, word in cases:
        got, reply = _post(url, "/v1/messages", body)
        assert got == status and set(reply) == {"type", "error"} and reply["type"] == "error", (body, reply)
        assert reply["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert word in reply["error"]["message"] and "Traceback" not in reply["error"]["message"], reply
    assert _post(url, "/v1/messages", b"{not json")[1]["error"]["type"] == "invalid_request_error"
    assert _post(url, "/v1/messages/count_tokens", {"model": model})[0] == 400
    got, reply = _post(url, "/v1/messages", cases[1][0], headers={"Authorization": "", "x-api-key": "wrong"})
    assert got == 401 and reply["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, max_tokens=0, messages=user)
    assert e.value.body["error"]["type"] == "invalid_request_error"


# ---- OpenAI's Responses API ------------------------------------------------------------------

def _reasoning_text(response) -> str:
    return "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or [])


def test_a_response_is_the_chat_completion_in_responses_shape(served, oai):
    _, model, thinks = served
    chat, thought = _chat(oai, model, 16)
    r = oai.responses.create(model=model, instructions=SYSTEM, max_output_tokens=16, temperature=0,
                             input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert [i.type for i in r.output] == (["reasoning"] if thinks else []) + ["message"]
    assert r.output_text == chat.choices[0].message.content and _reasoning_text(r) == thought
    assert r.status == {"length": "incomplete", "stop": "completed"}[chat.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert (r.usage.output_tokens_details.reasoning_tokens > 0) == thinks
    # a string input is one user message
    same = oai.responses.create(model=model, instructions=SYSTEM, max_output_tokens=16, temperature=0, input=ASK)
    assert same.output_text == r.output_text


def test_a_response_stream_is_numbered_events_in_their_order(served, oai):
    url, model, thinks = served
    body = {"model": model, "instructions": SYSTEM, "input": ASK, "max_output_tokens": 16, "temperature": 0}
    events = _sse(url, "/v1/responses", body)
    names = [n for n, _ in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    final = events[-1][1]["response"]
    added = [d["item"]["id"] for n, d in events if n == "response.output_item.added"]
    assert added == [d["item"]["id"] for n, d in events if n == "response.output_item.done"] == \
        [i["id"] for i in final["output"]]
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    thought = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    whole = oai.responses.create(**body)
    assert (text, thought) == (whole.output_text, _reasoning_text(whole)) and bool(thought) == thinks
    assert final["status"] == whole.status


def test_structured_output_and_the_client_stream_helper(served, oai):
    _, model, _ = served
    fmt = {"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}}
    with oai.responses.stream(model=model, input="Pick a color.", max_output_tokens=40, temperature=0,
                              text=fmt) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), COLOR)


def test_a_function_call_round_trip(served, oai):
    _, model, _ = served
    tools = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
              "parameters": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.responses.create(model=model, input=ask, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                             temperature=0)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with oai.responses.stream(model=model, input=ask, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                              temperature=0) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [json.loads(call.arguments)]
    back = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    answer = oai.responses.create(model=model, input=back, tools=tools, max_output_tokens=8, temperature=0)
    assert answer.usage.input_tokens > r.usage.input_tokens  # the call and its result reached the prompt


def test_bad_bodies_get_openais_error_shape(served):
    url, model, _ = served
    cases = [({"model": model}, "input"), ({"model": model, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
             ({"model": model, "input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
             ({"model": model, "input": [{"type": "computer_call", "id": "x"}]}, "input"),
             ({"model": model, "input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
             ({"model": model, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema")]
    for body, word in cases:
        status, reply = _post(url, "/v1/responses", body)
        assert status == 400 and set(reply) == {"error"}, (body, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"} and word in reply["error"]["message"], reply
