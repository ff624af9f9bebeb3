"""Chat prompts from the GGUF's `tokenizer.chat_template`, rendered like transformers'
`apply_chat_template`: a sandboxed jinja2 environment with the same options and helpers.

Templates come from model files, i.e. untrusted input, hence the immutable sandbox (no access
to Python internals) and limits on what a render may cost. The sandbox alone bounds neither
time nor memory (nested loops; `'x' * 10**7` in a loop; `s ~ s` doubling; `'{:>999999999}'`),
and most such costs are single C calls that no in-process hook can interrupt or measure. So
renders run in a small long-lived renderer process (coordinator/text/template_renderer.py): its
address space is capped (RENDER_MEMORY_BYTES above its size at start, so a memory bomb is a
MemoryError), the parent kills and replaces it when a render takes more than RENDER_SECONDS,
and the text it sends back is capped at MAX_OUTPUT_CHARS. Every failure is one
ChatTemplateError line starting "chat template: ".
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when the GGUF has no template: ChatML, which SmolLM2 and Qwen use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


MAX_OUTPUT_CHARS = 1 << 20        # far beyond any context a prompt must fit
MAX_TEMPLATE_CHARS = 1 << 20
RENDER_SECONDS = 5.0
RENDER_MEMORY_BYTES = 512 << 20   # on top of what the process already maps


class ChatTemplateError(ValueError, jinja2.exceptions.TemplateError):
    """A chat template that does not parse, fails, or exceeds a limit. A ValueError, so that
    the CLI prints it as one line; a TemplateError, as jinja's own errors were before."""

    def __init__(self, reason: str):
        super().__init__("chat template: " + " ".join(str(reason).split())[:400])


class ChatTemplateSecurityError(ChatTemplateError, jinja2.exceptions.SecurityError):
    """The template tried something the sandbox forbids (Python internals, mutating inputs)."""


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra) -> str:
    """The prompt text for `messages` (dicts with "role" and "content"). `extra` reaches the
    template as variables too (tools, documents, enable_thinking, ...). Raises
    ChatTemplateError (see the module's docstring for the limits)."""
    source = template or CHATML_TEMPLATE
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"{len(source)} characters, more than the limit of {MAX_TEMPLATE_CHARS}")
    variables = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                     bos_token=bos_token, eos_token=eos_token, **extra)
    return _render_isolated(source, variables)


def _render_limited(source: str, variables) -> str:
    # Compiled in the child too: jinja folds constant expressions at compile time, so
    # `{{ 'x' * 10**10 }}` would allocate 10 GB in whoever compiles it.
    try:
        compiled = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"does not parse: {e.message} (line {e.lineno})") from None
    out, n = [], 0
    for piece in compiled.generate(**variables):  # stop at the cap, not after building it all
        n += len(piece)
        if n > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"output exceeds {MAX_OUTPUT_CHARS} characters")
        out.append(piece)
    return "".join(out)


def serve_one(request) -> dict:
    """The renderer child's answer to one request {"source", "variables"}: {"ok": text} or
    {"error": reason} ("security": true for the sandbox's refusals; "restart": true after a
    MemoryError, which may have left the child's heap in a poor state)."""
    try:
        return {"ok": _render_limited(request["source"], request["variables"])}
    except ChatTemplateError as e:
        return {"error": str(e)[len("chat template: "):]}
    except MemoryError:
        return {"error": f"rendering needs more than {RENDER_MEMORY_BYTES >> 20} MiB of memory", "restart": True}
    except RecursionError:
        return {"error": "recursion too deep"}
    except jinja2.exceptions.SecurityError as e:
        return {"error": f"not allowed by the sandbox: {e}", "security": True}
    except Exception as e:  # raise_exception(), undefined names, type errors, ...
        return {"error": f"{type(e).__name__}: {e}"}


def _render_isolated(source: str, variables) -> str:
    from .template_renderer import RendererGone, RendererLate, renderer
    try:
        reply = renderer().render(source, variables, RENDER_SECONDS, RENDER_MEMORY_BYTES)
    except RendererLate:
        raise ChatTemplateError(f"rendering took longer than {RENDER_SECONDS:g} s") from None
    except RendererGone as e:
        raise ChatTemplateError(str(e)) from None
    if "error" in reply:
        raise (ChatTemplateSecurityError if reply.get("security") else ChatTemplateError)(reply["error"])
    text = reply.get("ok")
    if not isinstance(text, str) or len(text) > MAX_OUTPUT_CHARS:
        raise ChatTemplateError("the renderer's answer is not a text within the output limit")
    return text


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
