"""The OpenAI-compatible HTTP server, driven by the official `openai` client against a real
server (real worker processes) on a tiny model: chat and completions, streamed and not, stop
strings, logprobs, errors with their status codes, the API key, continuous batching (the same
greedy request alone and inside a batch of 4 gives the same tokens), prompt caching, a client
that disconnects, a taken port, signals, and `sparseinfer prompt` as a client."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest

from tests.conftest import HANG_S, REPO, children_of
from tests.fixtures import procs
from tests.fixtures.http_server import health, launched as _server

KEY = "test-key-123"
PROMPTS = ["the lazy dog", "a quick brown fox jumps", "once upon a time there", "hello world, hello"]


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True,
                          timeout=180, cwd=REPO, **kw)


def _health(url: str, key: str | None = None) -> tuple[int, dict]:
    """/health's status and body, asked with the tests' key (a server without one ignores it)."""
    return health(url, key or KEY)


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    with _server(tiny_model, tmp_path_factory.mktemp("srv"), "--api-key", KEY, "--parallel", "4") as (proc, url):
        yield proc, url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy continuations of PROMPTS from the engine directly, one at a time (the oracle)."""
    from coordinator.engine import Engine, EngineOptions
    from coordinator.sampling import SamplingParams

    with Engine(tiny_model, EngineOptions(threads=2, cpu_workers=1)) as eng:
        return {p: list(eng.generate(eng.tokenizer.encode(p), 12, SamplingParams(0.0), stop_at_eos=False))
                for p in PROMPTS}


def _ids(client, model_id, prompt: str, **kw) -> tuple[list[int], str]:
    """Greedy completion; its token ids, read back from logprobs' bytes through /tokenize-free means:
    the completions endpoint with logprobs=0 reports each token."""
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True}, **kw)
    return r.choices[0].logprobs.tokens, r.choices[0].text


def test_models_and_health(served, client, tiny_model):
    ids = [m.id for m in client.models.list().data]
    assert ids == [tiny_model.name.removesuffix(".gguf")]
    status, body = _health(served[1])
    assert status == 200 and body["status"] == "ok" and body["slots"] == 4
    # without the key (or with a wrong one) only the status: others' activity is not for all to see
    assert _health(served[1], key="wrong") == (200, {"status": "ok"})


def test_greedy_completion_matches_the_engine_alone_and_in_a_batch_of_4(served, client, model_id, reference):
    tk = _tokenizer(served)
    alone = {p: _ids(client, model_id, p) for p in PROMPTS}
    for p in PROMPTS:
        assert alone[p][1] == tk.decode(reference[p], skip_special=True), p
    results: dict[str, tuple] = {}

    def go(p):
        results[p] = _ids(client, model_id, p)
    threads = [threading.Thread(target=go, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


def _tokenizer(served):
    from coordinator.tokenizer import GGUFTokenizer
    from sparsecore.gguf_file import open_gguf

    if not hasattr(_tokenizer, "tk"):
        args = served[0].args
        _tokenizer.tk = GGUFTokenizer.from_reader(open_gguf(args[args.index("-m") + 1]))
    return _tokenizer.tk


def test_chat_streamed_equals_not_streamed_with_usage(client, model_id):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}]
    whole = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=10, temperature=0)
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model_id, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_across_token_boundaries(client, model_id):
    base = client.completions.create(model=model_id, prompt="the lazy dog", max_tokens=12, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    toks = base.choices[0].logprobs.tokens
    text = base.choices[0].text
    assert len(toks) >= 4
    # a stop string made of the end of one token and the start of the next: no single token
    # holds it (the tiny model's random text may hold partial UTF-8, where pieces and text differ)
    ends = [sum(map(len, toks[:i])) for i in range(2, len(toks) - 1)]
    clean = "".join(toks) == text and "\ufffd" not in text
    at = next((e for e in ends if clean and 0 < e < len(text) - 1), len(text) // 2)
    stop = text[at - 1:at + 1]
    cut = text.find(stop)
    assert 0 < cut < len(text)
    for stream in (False, True):
        r = client.completions.create(model=model_id, prompt="the lazy dog", max_tokens=12, temperature=0,
                                      stop=[stop, "never-appears"], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            parts = list(r)
            got, reason = "".join(c.choices[0].text for c in parts), parts[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert got == text[:cut] and reason == "stop", (stream, got, text, stop)


def test_logprobs_are_log_probabilities_and_greedy_picks_the_top(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(x <= 0 for x in tops)
        assert tok.logprob == pytest.approx(tops[0])  # greedy: the chosen token is the most likely
        assert tok.top_logprobs[0].token == tok.token


def test_seeded_sampling_is_reproducible_and_penalties_apply(client, model_id):
    kw = dict(model=model_id, prompt="once upon", max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True, "top_k": 40, "min_p": 0.01})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    plain = client.completions.create(model=model_id, prompt="la la la la la", max_tokens=12, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True})
    pen = client.completions.create(model=model_id, prompt="la la la la la", max_tokens=12, temperature=0,
                                    logprobs=0, frequency_penalty=2.0, presence_penalty=2.0,
                                    extra_body={"ignore_eos": True, "repeat_penalty": 5.0})
    t0, t1 = plain.choices[0].logprobs.tokens, pen.choices[0].logprobs.tokens
    assert len(set(t1)) >= len(set(t0)) and t0 != t1


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


def test_multi_turn_chat_reuses_the_cached_prefix(client, model_id):
    msgs = [{"role": "user", "content": "tell me about the lazy dog and the quick brown fox"}]
    first = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=6, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1, (cached, first.usage.prompt_tokens)


def test_a_client_that_disconnects_frees_its_slot(tiny_model_factory, tmp_path):
    """A client that goes away mid-stream (its socket closed, as when a user stops a reply)
    frees its slot long before the reply would have ended. A long context and reply: the tiny
    model decodes thousands of tokens a second while the server's HTTP thread shares a core
    with its spinning scheduler, so a disconnect can take a few hundred steps to be seen (a
    240-token reply on the 256-token model sometimes ended first)."""
    import http.client

    model_path = tiny_model_factory(tensor_type="F32", ctx=16384)
    with _server(model_path, tmp_path, "--parallel", "1", "--ctx", "16384") as (_, url):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        max_tokens = 12000
        body = json.dumps({"prompt": "the lazy dog", "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        for _ in range(6):  # a few events in: the sequence is decoding
            assert resp.fp.readline()
        assert _health(url)[1]["slots_busy"] == 1
        steps = _health(url)[1]["decode_steps"]
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
        conn.close()
        deadline = time.monotonic() + 30
        while _health(url)[1]["slots_busy"] and time.monotonic() < deadline:
            time.sleep(0.005)
        body = _health(url)[1]
        assert body["slots_busy"] == 0
        # freed by the disconnect, far from the reply's end
        assert body["decode_steps"] - steps < max_tokens // 4, body["decode_steps"] - steps


def test_tokenize_detokenize_round_trip(served):
    def post(path, obj):
        req = urllib.request.Request(served[1] + path, data=json.dumps(obj).encode(),
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    ids = post("/tokenize", {"content": "the lazy dog"})["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert post("/detokenize", {"tokens": ids})["content"] == "the lazy dog"


def test_prompt_command_is_a_client_of_the_server(served, reference):
    r = _run(["prompt", "--url", served[1], "--api-key", KEY, "-p", PROMPTS[0], "-n", "12", "--ignore-eos"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPTS[0]) and len(r.stdout.strip()) > len(PROMPTS[0])
    bad = _run(["prompt", "--url", served[1], "--api-key", "wrong", "-p", "x"])
    assert bad.returncode == 1 and "401" in bad.stderr and "Traceback" not in bad.stderr


def test_prompt_without_server_fails_clearly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    r = _run(["prompt", "-p", "x", "--url", f"http://127.0.0.1:{port}"])
    assert r.returncode == 1
    assert "no server at" in r.stderr and "Traceback" not in r.stderr


def test_a_taken_port_is_refused_in_one_line(served, tiny_model):
    port = served[1].rsplit(":", 1)[1]
    r = _run(["serve", "-m", str(tiny_model), "--port", port, "-t", "2"])
    assert r.returncode == 1
    assert "cannot listen on" in r.stderr and port in r.stderr and "Traceback" not in r.stderr


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_stop_the_server_cleanly_even_started_as_a_background_job(tiny_model, tmp_path, no_leaks, signum):
    """SIGTERM and SIGINT both stop the server and its workers and remove its ready file, also
    when it was started with SIGINT ignored, as a shell's background job is. SIGTERM, a service
    manager's stop, is a clean stop (status 0); Ctrl-C is 130."""
    with _server(tiny_model, tmp_path, preexec_fn=_ignore_sigint) as (server, _):
        workers = children_of(server.pid)
        assert workers
        server.send_signal(signum)
        assert server.wait(timeout=30) == (0 if signum == signal.SIGTERM else 130)
        assert ("stopped" if signum == signal.SIGTERM else "interrupted") in server.stderr.read()
        deadline = time.monotonic() + HANG_S  # gone with the server; this only catches one that stays
        while [p for p in workers if procs.alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if procs.alive(p)]
        assert not (tmp_path / "ready").exists()


def test_chat_repl_keeps_history_and_resets(tiny_model):
    """`sparseinfer chat` reads turns from stdin: a second turn continues the conversation
    (its KV cache is reused), /reset starts over (the same first reply again), /exit ends."""
    r = _run(["chat", "-m", str(tiny_model), "-t", "2", "--cpu-workers", "1", "-n", "6", "--system", "be brief",
              "--temperature", "0"],  # greedy: the same first reply after /reset (chat samples by default)
             input="hello there\nand more\n/reset\nhello there\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    assert len(replies) == 3, r.stdout
    assert replies[0] == replies[2] and replies[0]  # after /reset the same conversation again
    assert "conversation cleared" in r.stderr and "Traceback" not in r.stderr


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


def test_ctrl_c_in_chat_stops_the_reply_not_the_session(tiny_model):
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "chat", "-m", str(tiny_model), "-t", "2",
                             "--cpu-workers", "1", "-n", "200", "--ignore-eos"], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    try:
        proc.stdin.write("tell me a long story\n")
        proc.stdin.flush()
        # the reply is streaming once its first characters arrive
        first = proc.stdout.read(1)
        assert first, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("/exit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "[stopped]" in out and "Traceback" not in err


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


def test_an_empty_api_key_and_an_open_address_without_one_are_refused(tiny_model, tmp_path):
    r = _run(["serve", "-m", str(tiny_model), "--api-key", " ", "--port", "0"])
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--api-key" in r.stderr and "empty key" in r.stderr
    r = _run(["serve", "-m", str(tiny_model), "--host", "0.0.0.0", "--port", "0"])
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--no-api-key" in r.stderr
    with _server(tiny_model, tmp_path, "--host", "0.0.0.0", "--no-api-key") as (server, url):  # said explicitly
        assert _health(url) == (200, {**_health(url)[1], "status": "ok"}) and "slots" in _health(url)[1]


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


def test_silent_and_slow_connections_are_closed_at_the_header_deadline(tiny_model, tmp_path):
    """A connection that sends nothing, one that sends a header byte at a time, and one idle
    after its response are each closed by the server (--header-timeout 1), which serves on.
    The sockets' own timeout (HANG_S) only catches a server that never closes them."""
    with _server(tiny_model, tmp_path, "--header-timeout", "1") as (_, url):
        host, port = url.removeprefix("http://").split(":")
        socks = [socket.create_connection((host, int(port)), timeout=HANG_S) for _ in range(3)]
        silent, slow, idle = socks
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        slow.sendall(b"GET /hea")  # and no more: the rest of the request line never comes
        for s in socks:  # each is closed by the server: recv returns b"" (EOF), not a timeout
            while s.recv(4096):
                pass
            s.close()
        assert _health(url)[0] == 200


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_model_factory, tmp_path):
    """SIGTERM mid-stream (1500 tokens to go): the stream runs to its last token and [DONE]
    within --shutdown-grace, and the server exits 0."""
    import http.client

    with _server(tiny_model_factory(ctx=4096), tmp_path, "--shutdown-grace", "60", "--ctx", "4096") as (server, url):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=HANG_S)
        body = json.dumps({"prompt": "the lazy dog", "max_tokens": 1500, "temperature": 0, "stream": True,
                           "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline()  # decoding has begun
        server.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        conn.close()
        assert rest.rstrip().endswith("data: [DONE]")
        events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert len(events) > 1000 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert server.wait(timeout=HANG_S) == 0


def _complete(url: str, max_tokens: int = 3) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"prompt": "the lazy dog", "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HANG_S) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _workers(pid: int) -> list[int]:
    """The server's CPU worker processes (not multiprocessing's resource tracker)."""
    return [p for p in children_of(pid) if "cpu_worker" in procs.cmdline(p)]


def _wait_for(cond, what: str):
    deadline = time.monotonic() + HANG_S  # only catches a server that never gets there
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_dead_worker_is_restarted_and_a_second_death_exits_non_zero(tiny_model, tmp_path):
    """kill -9 of the CPU worker: the server says so in one line, restarts the engine's workers
    (/health "recovering" meanwhile) and serves again with nobody restarting anything; a second
    death within the window ends the server with a non-zero status, its workers gone."""
    with _server(tiny_model, tmp_path) as (server, url):
        assert _complete(url) == 200
        first = _workers(server.pid)
        assert first
        os.kill(first[0], signal.SIGKILL)
        _wait_for(lambda: _health(url)[1]["status"] != "ok", "the death was never noticed")
        _wait_for(lambda: _health(url)[0] == 200, "the server did not recover")
        assert _complete(url) == 200
        second = _workers(server.pid)
        assert second and not set(second) & set(first)
        os.kill(second[0], signal.SIGKILL)
        assert server.wait(timeout=HANG_S) == 1
        err = server.stderr.read()
        assert "restarting the engine's workers" in err and "exiting" in err.splitlines()[-1]
        _wait_for(lambda: not [p for p in second if procs.alive(p)], "workers left behind")


def test_on_worker_death_exit_ends_the_server_at_the_first_death(tiny_model, tmp_path):
    with _server(tiny_model, tmp_path, "--on-worker-death", "exit") as (server, url):
        assert _complete(url) == 200
        workers = _workers(server.pid)
        os.kill(workers[0], signal.SIGKILL)
        assert server.wait(timeout=HANG_S) == 1
        assert server.stderr.read().splitlines()[-1].startswith("error: ")


def _metrics(url: str, key: str | None = KEY) -> tuple[int, dict[str, float]]:
    """/metrics' status and its samples, {"name{labels}": value}, parsed by prometheus-client."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {}
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return 200, out


def test_metrics_are_scraped_and_move(served, client, model_id):
    """GET /metrics (Prometheus text, behind the key): request counts by endpoint and status,
    tokens, latency histograms and the live gauges move with a request."""
    assert _metrics(served[1], key="wrong")[0] == 401
    status, before = _metrics(served[1])
    assert status == 200 and before["sparseinfer_slots"] == 4 and before["sparseinfer_requests_waiting"] == 0
    r = client.completions.create(model=model_id, prompt="the quick brown fox", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    _, after = _metrics(served[1])
    ok = "sparseinfer_requests_total{endpoint=/v1/completions,status=200}"
    assert after[ok] == before.get(ok, 0) + 1
    nf = "sparseinfer_requests_total{endpoint=/v1/completions,status=404}"
    assert after[nf] == before.get(nf, 0) + 1
    assert after["sparseinfer_generated_tokens_total"] - before.get("sparseinfer_generated_tokens_total", 0) == 6
    assert after["sparseinfer_prompt_tokens_total"] > before.get("sparseinfer_prompt_tokens_total", 0)
    ttft = "sparseinfer_time_to_first_token_seconds_count"
    assert after[ttft] == before.get(ttft, 0) + 1
    tpot = "sparseinfer_time_per_output_token_seconds_count"
    assert after[tpot] == before.get(tpot, 0) + 5
    assert after["sparseinfer_decode_steps_total"] >= before["sparseinfer_decode_steps_total"] + 5
    assert after["sparseinfer_ffn_neurons_computed_total"] > before["sparseinfer_ffn_neurons_computed_total"]
