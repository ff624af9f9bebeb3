"""Hostile chat templates (they come from model files): every one ends quickly with one
ChatTemplateError line "chat template: ...", and the renderer leaves no process behind."""
from __future__ import annotations

import os
import time

import pytest

from coordinator import chat_template as ct
from coordinator.chat_template import ChatTemplateError, render_chat
from tests.conftest import children_of

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


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template(name):
    template, needle = HOSTILE[name]
    kids_before = set(children_of(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        render_chat(template, MSGS)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert msg.startswith("chat template: ") and "\n" not in msg, msg
    assert needle in msg, msg
    assert took < 4.0, f"{took:.1f}s"
    assert set(children_of(os.getpid())) <= kids_before  # the renderer was reaped or killed


def test_error_is_a_value_error_for_the_cli():
    with pytest.raises(ValueError):
        render_chat("{{ raise_exception('no') }}", MSGS)


def test_normal_templates_still_render():
    assert render_chat(None, MSGS) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    big = "z" * 100_000  # a long prompt is fine: the cap is far above any context
    assert render_chat("{{ messages[0].content }}", [{"role": "user", "content": big}]) == big


def test_render_is_quick():
    t0 = time.monotonic()
    for _ in range(20):
        render_chat(None, MSGS)
    assert (time.monotonic() - t0) / 20 < 0.1
