"""The OpenAI-compatible HTTP server's endpoints, driven by the official `openai` client against
a real server (real worker processes) on a tiny model: models and health, greedy completions
(the same tokens alone and inside a batch of 4 as the engine gives alone), chat streamed and not,
stop strings, logprobs, seeded sampling and penalties, prompt caching, /tokenize, /metrics, and
`sparseinfer prompt` as a client (with `sparseinfer chat` beside it). Refusals are in
tests/test_server_errors.py, servers started and stopped per test in tests/test_server_lifecycle.py;
what they share is tests/fixtures/openai_server.py."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import openai
import pytest

from tests.conftest import REPO
from tests.fixtures.openai_server import (  # noqa: F401, F811 (fixtures: client, model_id, ...)
    KEY, PROMPTS, client, greedy_ids as _ids, health_with_key as _health, model_id, reference, run_cli as _run,
    served, tokenizer_of as _tokenizer,
)


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


def test_multi_turn_chat_reuses_the_cached_prefix(client, model_id):
    msgs = [{"role": "user", "content": "tell me about the lazy dog and the quick brown fox"}]
    first = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=6, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1, (cached, first.usage.prompt_tokens)


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
