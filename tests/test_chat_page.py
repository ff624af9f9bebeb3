"""The chat page at GET / (coordinator/serve/web/chat.html): served without the API key, self-contained
(it names no other host, so it works offline), and driven in a real headless Chromium (Debian's
/usr/bin/chromium through Playwright, nothing downloaded) against a real server on SmolLM2: it
asks for the key on a 401, shows the model's name, streams a reply to a message sent with the
system prompt and sampling settings, keeps the conversation, and its Stop button ends a long
reply (the server frees the slot); a reasoning model's thinking shows folded, apart from its
answer. The screenshot is kept in tests/artifacts/chat_page.png."""
from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fixtures.http_server import health, launched

KEY = "page-key-1"
CHROMIUM = Path("/usr/bin/chromium")  # Debian's package (.ci/run installs it); Playwright's own browsers never
WAIT_MS = 60_000  # Playwright's bound on each wait: generous for a loaded machine, not a speed check
SCREENSHOT = REPO / "tests" / "artifacts" / "chat_page.png"


def _get(url: str, key: str | None = None) -> tuple[int, dict, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


def test_the_page_is_served_without_the_key_and_names_no_other_host(tiny_model, tmp_path, no_leaks):
    with launched(tiny_model, tmp_path, "--api-key", KEY) as (_, url):
        status, headers, page = _get(url + "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        # one file: no script or style from elsewhere, no link to another host
        assert re.findall(r"https?://|\bsrc\s*=|@import|url\(", page, re.I) == []
        assert all(h.startswith("data:") for h in re.findall(r'href\s*=\s*"([^"]*)"', page))
        # and the browser is told so: it may connect to this server only
        csp = headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        assert _get(url + "/v1/models")[0] == 401  # the API still wants the key
        assert _get(url + "/v1/models", KEY)[0] == 200


# Records the length of the last reply's text each time the page changes it: a streamed reply
# shows several lengths, one that arrives whole only its last.
WATCH_REPLY = """() => {
    window.lengths = [];
    new MutationObserver(() => {
        const text = document.querySelector('.msg.assistant:last-child .text');
        if (text) window.lengths.push(text.textContent.length);
    }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM} (.ci/run installs Debian's package)")
def test_a_browser_chats_with_streamed_replies_and_stops_one(smollm2_path, tmp_path, no_leaks):
    from playwright.sync_api import expect, sync_playwright

    with launched(smollm2_path, tmp_path, "--api-key", KEY) as (_, url), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.set_default_timeout(WAIT_MS)
        requests, chats, problems = [], [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and chats.append(r))
        page.on("pageerror", lambda e: problems.append(str(e)))
        # console errors (a CSP violation among them), but the expected 401 before the key is given
        page.on("console", lambda m: m.type == "error" and "status of 401" not in m.text and problems.append(m.text))
        try:
            page.goto(url + "/")
            expect(page.locator("#status")).to_contain_text("This server needs an API key (401", timeout=WAIT_MS)
            page.fill("#key", KEY)
            page.press("#key", "Enter")
            expect(page.locator("#model")).to_have_text(smollm2_path.name.removesuffix(".gguf"), timeout=WAIT_MS)
            expect(page.locator("#status")).to_be_empty(timeout=WAIT_MS)

            system = "You are a helpful assistant. Answer in one short sentence."
            page.fill("#system", system)
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "24")
            page.evaluate(WATCH_REPLY)
            page.fill("#input", "What is the capital of France?")
            page.click("#send")
            reply = page.locator(".msg.assistant").last
            expect(reply).to_have_attribute("data-state", "done", timeout=WAIT_MS)
            text = reply.locator(".text").text_content()
            lengths = page.evaluate("() => window.lengths")
            assert text.strip(), "no reply text"
            assert len({n for n in lengths if n}) >= 2 and lengths[-1] == len(text), lengths  # streamed
            expect(reply.locator(".meta")).to_contain_text("tokens in", timeout=WAIT_MS)
            first = chats[0]
            assert first.headers["authorization"] == f"Bearer {KEY}"
            body = first.post_data_json
            assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 24
            assert body["messages"] == [{"role": "system", "content": system},
                                        {"role": "user", "content": "What is the capital of France?"}]

            # a long reply (no max tokens: up to the context's end; greedy SmolLM2 lists these for
            # hundreds of tokens, seconds, and the click comes within milliseconds of the first),
            # stopped as soon as it shows: it stops growing and the server frees its slot
            page.fill("#max_tokens", "")
            page.fill("#input", "List the numbers from 1 to 1000, separated by commas.")
            page.click("#send")
            expect(page.locator("#stop")).to_be_enabled(timeout=WAIT_MS)
            long = page.locator(".msg.assistant").last
            expect(long.locator(".text")).not_to_be_empty(timeout=WAIT_MS)
            page.click("#stop")
            expect(long).to_have_attribute("data-state", "stopped", timeout=WAIT_MS)
            expect(page.locator("#send")).to_be_enabled(timeout=WAIT_MS)
            expect(page.locator("#stop")).to_be_disabled(timeout=WAIT_MS)
            shown = long.locator(".text").text_content()
            deadline = time.monotonic() + 30
            while health(url, KEY)[1]["slots_busy"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health(url, KEY)[1]["slots_busy"] == 0, "the stopped reply still holds its slot"
            assert long.locator(".text").text_content() == shown
            # the second turn carried the first (multi-turn history)
            assert [m["role"] for m in chats[1].post_data_json["messages"]] == ["system", "user", "assistant", "user"]
            assert chats[1].post_data_json["messages"][2]["content"] == text
            assert "max_tokens" not in chats[1].post_data_json  # a blank setting is left to the server

            assert problems == []
            assert all(u.startswith(url + "/") for u in requests), requests  # nothing from elsewhere
        finally:
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
            print(f"screenshot: {SCREENSHOT}")
            browser.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM} (.ci/run installs Debian's package)")
def test_the_page_folds_a_reasoning_models_thinking_apart_from_its_answer(tmp_path, no_leaks):
    """A tiny model whose Qwen3 template opens the thinking block, served with a budget: the
    thinking streams into a folded <details> above the answer, never into the answer, and only
    the answer goes back as the conversation's history."""
    from playwright.sync_api import expect, sync_playwright

    from tests.fixtures.reasoning_outputs import QWEN3_OPENS_THINKING
    from tests.fixtures.tiny_gguf import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny-qwen3-thinking.gguf", chat_template=QWEN3_OPENS_THINKING, ctx=1024)
    with launched(model, tmp_path, "--reasoning-budget", "5") as (_, url), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        page = browser.new_page()
        page.set_default_timeout(WAIT_MS)
        chats, problems = [], []
        page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and chats.append(r))
        page.on("pageerror", lambda e: problems.append(str(e)))
        try:
            page.goto(url + "/")
            expect(page.locator("#model")).to_have_text("tiny-qwen3-thinking", timeout=WAIT_MS)
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "20")
            for turn in ("hello", "and again"):
                page.fill("#input", turn)
                page.click("#send")
                reply = page.locator(".msg.assistant").last
                expect(reply).to_have_attribute("data-state", "done", timeout=WAIT_MS)
            box = reply.locator("details.thinking")
            expect(box).to_have_count(1)
            assert box.get_attribute("open") is None  # folded until the reader opens it
            expect(box.locator("summary")).to_contain_text("Thought (")
            thought, answer = box.locator(".thought").text_content(), reply.locator(".text").text_content()
            assert thought.strip() and answer.strip() and "</think>" not in answer and thought not in answer
            box.locator("summary").click()
            expect(box.locator(".thought")).to_be_visible()
            history = chats[1].post_data_json["messages"]
            assert [m["role"] for m in history] == ["user", "assistant", "user"]
            assert "reasoning_content" not in history[1] and "</think>" not in history[1]["content"]
            assert problems == []
        finally:
            browser.close()
