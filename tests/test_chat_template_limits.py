"""Hostile chat templates (they come from model files): every one is stopped by one of the
renderer's limits (deadline, memory, output size, template size, sandbox) with one
ChatTemplateError line "chat template: ..." saying which, and at most one renderer process
stays (the long-lived one: a late or broken one is replaced, never added to). No test times a
render: the limits bound the work, a hang guard catches a limit that no longer stops anything."""
from __future__ import annotations

import os
import signal
import time

import pytest

from coordinator.text import chat_template as ct
from coordinator.text.chat_template import ChatTemplateError, render_chat
from coordinator.text.template_renderer import renderer
from tests.conftest import HANG_S, children_of, hang_guard
from tests.fixtures import procs

MSGS = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "nested_loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                     "longer than"),
    "string_times": ("{% for i in range(1000) %}{{ 'x' * 10**7 }}{% endfor %}", "output exceeds"),
    "huge_string": ("{{ 'x' * 10**10 }}", "memory"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}{{ ns.s|length }}", "memory"),
    "big_range": ("{% for i in range(10**9) %}{% endfor %}", "range"),
    "huge_power": ("{{ 7 ** 10000000000 }}", "longer than"),
    "format_width": ("{{ '{:>9999999999}'.format(1) }}", "memory"),
    "macro_recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    "exponential_macros": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
                           "longer than"),
    "sandbox_class": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "__class__"),
    "sandbox_mutation": ("{{ messages.append(1) }}", "sandbox"),
    "raises": ("{{ raise_exception('Conversation roles must alternate') }}", "alternate"),
    "syntax": ("{% for %}", "does not parse"),
    "undefined_call": ("{{ nothing() }}", "Undefined"),
    "output_cap": ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "output exceeds"),
}


@pytest.fixture(autouse=True)
def fast_limits(monkeypatch):
    monkeypatch.setattr(ct, "RENDER_SECONDS", 2.0)


def _renderers() -> set[int]:
    return {p for p in children_of(os.getpid()) if "coordinator.text.template_renderer" in procs.cmdline(p)}


def _threads(pid: int) -> int:
    """Threads of pid still alive (a killed process's leader is a zombie before its other threads
    have gone, and cannot be reaped until they have)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _kill_renderers(spare: set[int]):
    def kill():
        for pid in set(children_of(os.getpid())) - spare:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return kill


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template(name):
    """The needle says which limit stopped it. Far above RENDER_SECONDS (2 s here), the hang
    guard only catches a render no limit stops (it kills the renderer, then fails)."""
    template, needle = HOSTILE[name]
    kids_before = set(children_of(os.getpid()))
    with hang_guard(f"rendering {name}", HANG_S, on_hang=_kill_renderers(kids_before)):
        with pytest.raises(ChatTemplateError) as e:
            render_chat(template, MSGS)
    msg = str(e.value)
    assert msg.startswith("chat template: ") and "\n" not in msg, msg
    assert needle in msg, msg
    assert len(_renderers()) <= 1  # a late renderer was killed and reaped, not left beside a new one
    assert set(children_of(os.getpid())) - _renderers() <= kids_before


def test_error_is_a_value_error_for_the_cli():
    with pytest.raises(ValueError):
        render_chat("{{ raise_exception('no') }}", MSGS)


def test_normal_templates_still_render():
    assert render_chat(None, MSGS) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    big = "z" * 100_000  # a long prompt is fine: the cap is far above any context
    assert render_chat("{{ messages[0].content }}", [{"role": "user", "content": big}]) == big


class _TooManySteps(BaseException):
    """Raised by a template's own callback past its step budget: not an Exception, so neither
    jinja nor the renderer turns it into a ChatTemplateError."""


def test_renders_share_one_renderer_and_the_output_is_capped_in_steps():
    """The work of a render is bounded by counts, not timed: (1) 20 renders are answered by one
    long-lived renderer process (not a process each), and a killed one is replaced by exactly
    one; (2) a template over MAX_TEMPLATE_CHARS is refused before the renderer sees it; (3)
    generation stops at the output cap: a template that would call back 10**10 times, each call
    100 characters, is stopped after MAX_OUTPUT_CHARS // 100 + 1 calls (counted in-process by
    the callback, which also stops a runaway render at 10x that; serve_one, the renderer's
    answer to a request, run here so that the callback can count)."""
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(None, MSGS) == want
    started, pids = renderer().started, _renderers()
    assert len(pids) == 1
    assert [render_chat(None, MSGS) for _ in range(20)] == [want] * 20
    assert renderer().started == started and _renderers() == pids

    dead = next(iter(pids))
    os.kill(dead, signal.SIGKILL)  # a renderer that died between renders is replaced
    with hang_guard("the killed renderer to exit", HANG_S):  # a zombie whose threads are all gone: reapable
        while procs.stat_fields(dead) is not None and (procs.stat_fields(dead)[0] != "Z" or _threads(dead) > 1):
            time.sleep(0.01)
    assert render_chat(None, MSGS) == want
    assert len(_renderers()) == 1 and _renderers() != pids

    started = renderer().started
    with pytest.raises(ChatTemplateError, match="more than the limit"):
        render_chat("x" * (ct.MAX_TEMPLATE_CHARS + 1), MSGS)
    assert renderer().started == started

    piece, calls = "y" * 100, []
    cap_calls = ct.MAX_OUTPUT_CHARS // len(piece) + 1

    def tick():
        calls.append(1)
        if len(calls) > 10 * cap_calls:
            raise _TooManySteps
        return piece

    endless = "{% for a in range(100000) %}{% for b in range(100000) %}{{ tick() }}{% endfor %}{% endfor %}"
    try:  # the renderer's own answer to a request, computed here (serve_one runs in the renderer)
        reply = ct.serve_one({"source": endless, "variables": dict(messages=MSGS, tick=tick)})
    except _TooManySteps:
        pytest.fail(f"the output cap did not stop generation after {len(calls)} pieces")
    assert reply == {"error": f"output exceeds {ct.MAX_OUTPUT_CHARS} characters"}
    assert len(calls) == cap_calls
