"""What the OpenAI-compatible server refuses, and how: errors in OpenAI's shape with their
status codes, prompts beyond the context or the body limit, a missing API key, hostile and
malformed bodies, fields it cannot honour, a taken port, an empty key or an open address
without one, and requests beyond the slots and the queue (503); after each, the server serves
on. Against a real server on the tiny model (tests/fixtures/openai_server.py's, one for the
module), and servers of their own where the refusal is at start or needs one slot."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.conftest import HANG_S
from tests.fixtures.http_server import launched as _server
from tests.fixtures.openai_server import (  # noqa: F401, F811 (fixtures: client, model_id, ...)
    KEY, PROMPTS, client, greedy_ids as _ids, health_with_key as _health, model_id, reference, run_cli as _run,
    served, tokenizer_of as _tokenizer,
)


@pytest.mark.parametrize("kw, status", [
    (dict(max_tokens=100000), 400),
    (dict(temperature=-1), 400),
    (dict(top_p=0), 400),
    (dict(n=2), 400),
    (dict(extra_body={"stop": ["x"] * 100}), 400),
    (dict(model="no-such-model"), 404),
])
def test_errors_have_openai_shape_and_status(served, client, model_id, reference, kw, status):
    args = dict(model=model_id, prompt="hello", max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body if isinstance(e.value.body, dict) else {}
    assert err.get("message") and err.get("type"), e.value.body
    # the server keeps serving, and what it serves is still the engine's greedy continuation
    assert _ids(client, model_id, PROMPTS[0])[1] == _tokenizer(served).decode(reference[PROMPTS[0]], skip_special=True)


def test_prompt_beyond_the_context_is_refused(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="word " * 5000, max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_api_key_is_required(served, model_id):
    bad = openai.OpenAI(base_url=served[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert _health(served[1])[0] == 200  # health stays public, as llama-server's


def test_huge_prompts_are_refused_before_any_work(served, client, model_id):
    """Refused from its length before it is tokenized (the message counts characters, not
    tokens), and no decode step ran for it: work bounded by what was done, not by a clock."""
    before = _health(served[1])[1]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="x" * 3_000_000, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    assert "3000000 characters are at least" in e.value.message, e.value.message
    after = _health(served[1])[1]
    if before["slots_busy"] == after["slots_busy"] == 0:  # nothing else was decoding meanwhile
        assert after["decode_steps"] == before["decode_steps"]
    with pytest.raises(openai.APIStatusError) as e:  # beyond the body limit: refused unread
        client.completions.create(model=model_id, prompt="x" * 9_000_000, max_tokens=1)
    assert e.value.status_code == 413
    assert _health(served[1])[0] == 200


HOSTILE = [
    (b"not json", "application/json"),
    (b"{", "application/json"),
    (b"[]", "application/json"),
    (b"null", "application/json"),
    (b'{"prompt": 123}', "application/json"),
    (b'{"prompt": null, "max_tokens": null}', "application/json"),
    (b'{"prompt": "x", "max_tokens": "many"}', "application/json"),
    (b'{"prompt": "x", "max_tokens": 1e308}', "application/json"),
    (b'{"prompt": "x", "max_tokens": -5}', "application/json"),
    (b'{"prompt": "x", "temperature": "hot"}', "application/json"),
    (b'{"prompt": "x", "temperature": NaN}', "application/json"),
    (b'{"prompt": "x", "seed": 1e400}', "application/json"),
    (b'{"prompt": "x", "seed": 99999999999999999999999999999}', "application/json"),
    (b'{"prompt": [1, 2, 99999999]}', "application/json"),
    (b'{"prompt": [-1]}', "application/json"),
    (b'{"prompt": [[1, 2], [3]]}', "application/json"),
    (b'{"prompt": ["a", "b"]}', "application/json"),
    (b'{"prompt": {"x": 1}}', "application/json"),
    (b'{"prompt": "x", "stop": 5}', "application/json"),
    (b'{"prompt": "x", "stop": [1, 2]}', "application/json"),
    (b'{"prompt": "x", "logprobs": 1000}', "application/json"),
    (b'{"prompt": "x", "stream": "yes"}', "application/json"),
    (b'{"prompt": "\\ud800"}', "application/json"),
    (b'{"prompt": "x", "n": 0}', "application/json"),
    (b'{"prompt": "x"' + b', "a": [' * 5000 + b']' * 5000 + b'}', "application/json"),
    (b'\xff\xfe\x00garbage', "application/json"),
    (b'{"prompt": "x"}', "text/plain"),
]


@pytest.mark.parametrize("body, ctype", HOSTILE, ids=[f"h{i}" for i in range(len(HOSTILE))])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_hostile_requests_get_an_error_and_the_server_keeps_serving(served, client, model_id, body, ctype, path):
    req = urllib.request.Request(served[1] + path, data=body, headers={"Authorization": f"Bearer {KEY}",
                                                                     "Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, reply = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, reply = e.code, e.read()
    assert 400 <= status < 500 or status == 200, (status, reply[:200])
    if status >= 400:
        assert "error" in json.loads(reply) and b"Traceback" not in reply
    assert _health(served[1])[0] == 200


def test_a_50_mb_request_is_refused_at_once(served):
    """Refused from its Content-Length, unread: a request that declares 50 MB and sends none of
    it is answered 413 (a server that read the body first would wait for bytes that never come:
    the socket's timeout, far above an honest answer's milliseconds, catches that)."""
    import http.client

    host, port = served[1].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_S)
    try:
        conn.putrequest("POST", "/v1/completions")
        for k, v in (("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
                     ("Content-Length", str(50 << 20))):
            conn.putheader(k, v)
        conn.endheaders()  # and no body
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    # and sent in full: the same answer, the server still serving
    req = urllib.request.Request(served[1] + "/v1/completions", data=b"x" * (50 << 20),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        status = 200
    except urllib.error.HTTPError as e:
        status = e.code
    except (ConnectionError, urllib.error.URLError):
        status = 413  # the server answered 413 and closed before the client finished sending
    assert status == 413
    assert _health(served[1])[0] == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_seed_minus_one_is_random_and_below_is_refused(served, path):
    """seed -1 is llama.cpp's (and the CLI's) random seed: served, not a 500; -2 is a 400 naming seed."""
    body = {"prompt": "once upon", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for seed, want in ((-1, 200), (-2, 400), (2 ** 64, 400)):
        req = urllib.request.Request(served[1] + path, data=json.dumps({**body, "seed": seed}).encode(),
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=HANG_S) as r:
                status, reply = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, reply = e.code, e.read()
        assert status == want, (seed, status, reply[:200])
        if status == 400:
            assert b"seed" in reply


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "echo": True}, "echo"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/tokenize", {"content": "a" * ((1 << 20) + 1)}, "content"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
], ids=["bool-ids", "echo", "bool-detokenize", "long-tokenize", "best_of", "suffix", "n"])
def test_requests_we_cannot_honour_are_400s_naming_the_field(served, path, body, param):
    """Not coerced (true as token 1) or silently ignored (echo): a 400 that names the field."""
    req = urllib.request.Request(served[1] + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=HANG_S)
    assert ei.value.code == 400
    assert json.loads(ei.value.read())["error"]["message"].startswith(param)


def test_a_body_that_is_not_json_gets_a_400_saying_so(served):
    for ctype in (None, "text/plain"):
        headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": ctype} if ctype else {})}
        req = urllib.request.Request(served[1] + "/v1/completions", data=b'{"prompt": "x"}', headers=headers)
        if ctype is None:  # urllib adds a form content type to a body without one
            req.remove_header("Content-type")
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=HANG_S)
        assert ei.value.code == 400
        assert "Content-Type must be application/json" in json.loads(ei.value.read())["error"]["message"]


def test_a_chunked_body_over_the_limit_is_a_413_and_a_small_one_is_served(served, model_id):
    """Chunked bodies carry no Content-Length: read up to the limit, then refused as sized ones
    are (not a 400 'error parsing the body'); a small chunked request is served as usual."""
    import http.client

    host, port = served[1].removeprefix("http://").split(":")

    def post(chunks) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=HANG_S)
        try:
            conn.request("POST", "/v1/completions", body=iter(chunks), encode_chunked=True,
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        except ConnectionError:
            return 413, b""  # answered and closed before the client finished sending
        finally:
            conn.close()

    status, _ = post([b'{"prompt": "', *([b"x" * (1 << 20)] * 9), b'"}'])
    assert status == 413
    status, reply = post([b'{"prompt": "the lazy', b' dog", "max_tokens": 2, ', b'"model": "' + model_id.encode() + b'"}'])
    assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 2
    assert _health(served[1])[0] == 200


def test_a_taken_port_is_refused_in_one_line(served, tiny_model):
    port = served[1].rsplit(":", 1)[1]
    r = _run(["serve", "-m", str(tiny_model), "--port", port, "-t", "2"])
    assert r.returncode == 1
    assert "cannot listen on" in r.stderr and port in r.stderr and "Traceback" not in r.stderr


def test_an_empty_api_key_and_an_open_address_without_one_are_refused(tiny_model, tmp_path):
    r = _run(["serve", "-m", str(tiny_model), "--api-key", " ", "--port", "0"])
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--api-key" in r.stderr and "empty key" in r.stderr
    r = _run(["serve", "-m", str(tiny_model), "--host", "0.0.0.0", "--port", "0"])
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--no-api-key" in r.stderr
    with _server(tiny_model, tmp_path, "--host", "0.0.0.0", "--no-api-key") as (server, url):  # said explicitly
        assert _health(url) == (200, {**_health(url)[1], "status": "ok"}) and "slots" in _health(url)[1]


def test_beyond_the_slots_and_the_queue_requests_get_503(tiny_model_factory, tmp_path):
    # a long context: the busy request must outlast the next one's arrival (a tiny model decodes
    # thousands of tokens a second, so 200 of them could end first and free the slot)
    model_path = tiny_model_factory(tensor_type="F32", ctx=16384)
    with _server(model_path, tmp_path, "--parallel", "1", "--queue", "0", "--ctx", "16384") as (_, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        busy = c.completions.create(model=model, prompt="the lazy dog", max_tokens=16000, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
        next(iter(busy))  # the one slot is decoding
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=model, prompt="hello", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "overloaded"
        with pytest.raises(openai.APIStatusError) as e:  # refused before its template is rendered
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "overloaded"
        busy.close()
        deadline = time.monotonic() + 10
        while _health(url)[1]["slots_busy"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.completions.create(model=model, prompt="hello", max_tokens=2).usage.completion_tokens >= 1
