"""Chat prompts from the GGUF's `tokenizer.chat_template`, rendered like transformers'
`apply_chat_template`: a sandboxed jinja2 environment with the same options and helpers.

Templates come from model files, i.e. untrusted input, hence the immutable sandbox (no access
to Python internals) and limits on what a render may cost. The sandbox alone bounds neither
time nor memory (nested loops; `'x' * 10**7` in a loop; `s ~ s` doubling; `'{:>999999999}'`),
and most such costs are single C calls that no in-process hook can interrupt or measure. So a
render runs in a forked child: an address-space limit (RLIMIT_AS, its current size plus
RENDER_MEMORY_BYTES) turns a memory bomb into a MemoryError, the parent kills it after
RENDER_SECONDS, and the text it sends back is capped at MAX_OUTPUT_CHARS. The fork costs a few
milliseconds (copy-on-write; the child only compiles and renders the template and exits with
os._exit, so it never touches the parent's sockets, threads or torch). Every failure is one
ChatTemplateError line starting "chat template: ".
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import threading
import time
import warnings
from datetime import datetime

import msgpack

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


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child(source: str, variables, wfd: int) -> None:
    """The forked child's whole life: render, send {ok|error}, _exit. Never returns."""
    try:
        limit = _vm_bytes() + RENDER_MEMORY_BYTES
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        try:
            reply = {"ok": _render_limited(source, variables)}
        except ChatTemplateError as e:
            reply = {"error": str(e)[len("chat template: "):]}
        except MemoryError:
            reply = {"error": f"rendering needs more than {RENDER_MEMORY_BYTES >> 20} MiB of memory"}
        except RecursionError:
            reply = {"error": "recursion too deep"}
        except jinja2.exceptions.SecurityError as e:
            reply = {"error": f"not allowed by the sandbox: {e}", "security": True}
        except Exception as e:  # raise_exception(), undefined names, type errors, ...
            reply = {"error": f"{type(e).__name__}: {e}"}
        data = msgpack.packb(reply)
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]
    except BaseException:
        os._exit(1)
    os._exit(0)


# One render at a time: the child is forked from a threaded process (the HTTP server renders in
# a thread pool), and a lock another thread held inside jinja at the fork would stay locked in
# the child forever. With renders serialized, no thread is inside jinja when we fork.
_FORK_LOCK = threading.Lock()


def _render_isolated(source: str, variables) -> str:
    with _FORK_LOCK:
        return _render_forked(source, variables)


def _render_forked(source: str, variables) -> str:
    r, w = os.pipe()
    try:
        with warnings.catch_warnings():  # 3.12+ warns about fork with threads; the child runs no thread
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as e:
        os.close(r), os.close(w)
        raise ChatTemplateError(f"cannot start the renderer: {e}") from None
    if pid == 0:
        os.close(r)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent's handlers must not run here
        _child(source, variables, w)
    os.close(w)
    chunks, size, killed = [], 0, False
    deadline = time.monotonic() + RENDER_SECONDS
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                killed = True
                break
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > 4 * MAX_OUTPUT_CHARS + 1024:  # cannot happen with our child; bound it anyway
                killed = True
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        if killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
    if killed:
        raise ChatTemplateError(f"rendering took longer than {RENDER_SECONDS:g} s")
    try:
        reply = msgpack.unpackb(b"".join(chunks))
    except Exception:
        reply = None
    if not isinstance(reply, dict):
        raise ChatTemplateError(f"the renderer ended without an answer (wait status {status})")
    if "error" in reply:
        raise (ChatTemplateSecurityError if reply.get("security") else ChatTemplateError)(reply["error"])
    return reply["ok"]


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
