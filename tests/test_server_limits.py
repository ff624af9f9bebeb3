"""The server under the loads an operator worries about, against a real server and real workers:
hundreds of idle and slowloris connections closed at their deadlines while requests are served,
a body trickled past its deadline (408), a 7 MB /tokenize beside a running stream (refused
without stalling it), per-request work bounded off the event loop, and a kill -9 of the server
leaving no process, segment or ready file. Timeouts here only catch a hang; the one timing
assertion is the issue's own bound on a stream's gap between tokens (1 s, against ~10 ms)."""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import HANG_S, children_of, orphaned_segments, shm_segments
from tests.fixtures import procs
from tests.fixtures.http_server import launched


def _post(url: str, path: str, body: bytes, timeout: float = HANG_S) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=HANG_S)


def _wait_closed(socks: list[socket.socket], seconds: float) -> list[socket.socket]:
    """The sockets the server has not closed (EOF or reset) within `seconds`."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    open_ = set(socks)
    deadline = time.monotonic() + seconds
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionResetError:
                data = b""
            except BlockingIOError:
                continue
            if data == b"":
                sel.unregister(key.fileobj)
                open_.discard(key.fileobj)
    sel.close()
    return list(open_)


def test_300_idle_and_50_slowloris_connections_are_closed_while_requests_are_served(tiny_model, tmp_path):
    with launched(tiny_model, tmp_path, "--header-timeout", "3") as (_, url):
        idle = [_connect(url) for _ in range(300)]
        slow = [_connect(url) for _ in range(50)]
        stop = threading.Event()

        def trickle():  # a header byte every half second: never a whole request
            line = b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 200
            i = 0
            while not stop.is_set() and i < len(line):
                for s in slow:
                    try:
                        s.sendall(line[i:i + 1])
                    except OSError:
                        pass
                i += 1
                stop.wait(0.5)
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        try:
            for _ in range(3):  # the server serves meanwhile
                assert _post(url, "/v1/completions", json.dumps({"prompt": "the lazy dog", "max_tokens": 4}).encode())[0] == 200
                with urllib.request.urlopen(url + "/health", timeout=HANG_S) as r:
                    assert r.status == 200
            left = _wait_closed(idle + slow, HANG_S)
            assert not left, f"{len(left)} of 350 connections still open"
        finally:
            stop.set()
            t.join(HANG_S)
            for s in idle + slow:
                s.close()
        assert _post(url, "/v1/completions", json.dumps({"prompt": "the lazy dog", "max_tokens": 4}).encode())[0] == 200


def test_a_body_trickled_past_its_deadline_gets_408_and_the_connection_closes(tiny_model, tmp_path):
    with launched(tiny_model, tmp_path, "--body-timeout", "1") as (_, url):
        s = _connect(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # and the rest never comes
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        s.close()
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply[:200]
        assert "not received within 1 s" in json.loads(body)["error"]["message"]
        assert _post(url, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())[0] == 200


def test_a_7_mb_tokenize_beside_a_stream_is_refused_without_stalling_it(tiny_model_factory, tmp_path):
    """A stream of 400 tokens runs while 7 MB /tokenize bodies arrive, and texts just within
    and just beyond what the context could hold: the 7 MB ones and the one beyond are refused
    (400, naming the limit) before any tokenizing, the one within is tokenized off the event
    loop, and the stream's longest gap between tokens stays under a second."""
    model = tiny_model_factory(ctx=1024)
    with launched(model, tmp_path) as (_, url):
        gaps, done = [], threading.Event()

        def stream():
            body = json.dumps({"prompt": "the lazy dog", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            last = None
            with urllib.request.urlopen(req, timeout=HANG_S) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            done.set()
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        while not gaps and t.is_alive():
            time.sleep(0.01)
        big = json.dumps({"content": "the lazy dog " * 540_000}).encode()  # 7 MB
        refused = [_post(url, "/tokenize", big) for _ in range(3)]
        chars = 1024 * _longest_token_chars(model)  # at least this many characters make more than 1024 tokens
        within = _post(url, "/tokenize", json.dumps({"content": "dog " * (chars // 8)}).encode())
        beyond = _post(url, "/tokenize", json.dumps({"content": "d" * (chars + _longest_token_chars(model))}).encode())
        t.join(HANG_S)
        assert done.is_set() and len(gaps) >= 300
        assert [s for s, _ in refused] == [400] * 3
        assert within[0] == 200 and len(within[1]["tokens"]) > 0
        assert beyond[0] == 400 and "context" in beyond[1]["error"]["message"]
        assert max(gaps) < 1.0, f"a stream stalled {max(gaps):.2f} s"


def _longest_token_chars(model) -> int:
    from coordinator.text.tokenizer import GGUFTokenizer
    from sparsecore.gguf_file import open_gguf
    return GGUFTokenizer.from_reader(open_gguf(model)).longest_token_chars


def test_kill_9_of_the_server_leaves_no_process_segment_or_ready_file(tiny_model, tmp_path):
    """The server's workers, its template renderer (started by a chat request) and the ready
    file's reaper: after kill -9 of the server all processes end and the ready file is removed."""
    before = shm_segments()
    with launched(tiny_model, tmp_path) as (server, url):
        status, _ = _post(url, "/v1/chat/completions",
                          json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode())
        assert status == 200
        kids = children_of(server.pid)
        assert any("template_renderer" in procs.cmdline(p) for p in kids)
        assert any("cpu_worker" in procs.cmdline(p) for p in kids)
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        deadline = time.monotonic() + HANG_S  # the reapers' work: this only catches one that never ends

        def left():
            return ([p for p in kids if procs.alive(p)], (tmp_path / "ready").exists(),
                    orphaned_segments(shm_segments() - before))
        while any(left()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left() == ([], False, set())


@pytest.mark.parametrize("n", [8])
def test_per_request_work_runs_a_bounded_number_at_a_time(served_tiny, n):
    """n concurrent /tokenize requests are all answered, the event loop answering /health in
    between (the work runs in at most WORK_THREADS threads)."""
    url = served_tiny
    results = []
    body = json.dumps({"content": "the lazy dog " * 40}).encode()
    threads = [threading.Thread(target=lambda: results.append(_post(url, "/tokenize", body)[0])) for _ in range(n)]
    for t in threads:
        t.start()
    with urllib.request.urlopen(url + "/health", timeout=HANG_S) as r:
        assert r.status == 200
    for t in threads:
        t.join(HANG_S)
    assert results == [200] * n


@pytest.fixture(scope="module")
def served_tiny(tiny_model, tmp_path_factory):
    with launched(tiny_model, tmp_path_factory.mktemp("lim")) as (_, url):
        yield url
