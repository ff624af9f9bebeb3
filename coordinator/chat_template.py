"""Chat prompts from the GGUF's `tokenizer.chat_template`, rendered like transformers'
`apply_chat_template`: a sandboxed jinja2 environment with the same options and helpers.

Templates come from model files, i.e. untrusted input, hence the immutable sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime

import gguf
import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# Used when the GGUF has no template: ChatML, which SmolLM2 and Qwen use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_template_from_reader(reader: gguf.GGUFReader) -> str | None:
    field = reader.fields.get(CHAT_TEMPLATE_KEY)
    if field is None:
        return None
    value = field.contents()
    if not isinstance(value, str):
        raise ValueError(f"{CHAT_TEMPLATE_KEY} must be a string")
    return value or None


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra) -> str:
    """The prompt text for `messages` (dicts with "role" and "content"). `extra` reaches the
    template as variables too (tools, documents, enable_thinking, ...)."""
    compiled = _environment().from_string(template or CHATML_TEMPLATE)
    return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token, eos_token=eos_token, **extra)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF;
    for rendering it is a no-op, but templates using it must still parse."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's version: jinja's own tojson escapes HTML characters, which would change prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV: ImmutableSandboxedEnvironment | None = None


def _environment() -> ImmutableSandboxedEnvironment:
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV
