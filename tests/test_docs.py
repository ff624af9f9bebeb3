"""The docs name code that exists, and their links resolve.

README.md and docs/*.md name files, classes, methods and functions; a rename that leaves a
sentence behind makes the docs lie. This reads every doc and checks, without importing the
engine:

- a path (`coordinator/model/transformer.py`, `sparsecore/kernels/interleaved_*.c`, `tests/x.py::test_y`,
  `tools/observe.py`, a bare `engine_build.py`) names a file or folder of the repository;
- a `Class.member` (in inline code, or in a fenced block's diagram) whose class is one of ours
  names a method, attribute or field of that class (or of a base class of ours); a
  `module.name` (`sparsecore.ffn.is_active`, `sampling.pick_next`) names something defined or
  imported at the module's top level; `_kernels.name` names a function of the C module's
  method table (sparsecore/kernels/python_module.c);
- a file followed by a name (`coordinator/runtime/decode_plan.py` `plan_decode`, `sparsecore/shard.py`,
  `FfnShard.serve`, `file_matrix.py`: `FileMatrix`, `ffn_step.c` `ffn_teal`, `transformer.py:forward`)
  names something that file defines (Python: `ast`; C: a function definition, macro, type or
  constant);
- a class-like name alone (`FfnShard`, `Scheduler`) is a name the Python code defines or takes
  from another project, and a constant alone (`MAX_SMALL_BATCH`, `K_AHEAD`) one the code defines;
- a link to another page, and its #anchor, resolves.

Prose is left alone: option values, commands, JSON keys, GGUF keys (`general.architecture`,
`blk.N.fc1`), other projects' names (`torch.sum`, `gguf.GGUFWriter`) and files of other
projects (EXTERNAL_FILES) are not code of ours. One failure lists every stale reference.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Top-level folders of the repository a path in the docs may start with.
TOP = ("coordinator", "sparsecore", "cpu_worker", "gpu_worker", "protocol", "sparseinfer", "scripts",
       "tests", "docs", ".ci")
# Python packages whose modules a dotted `module.name` may name.
PACKAGES = ("coordinator", "sparsecore", "cpu_worker", "gpu_worker", "protocol", "sparseinfer")
# Files of other projects the docs name (DESIGN.md's conventions worth copying, llama.cpp's
# converter, gguf-py's reader): no file of ours.
EXTERNAL_FILES = {"convert_hf_to_gguf.py", "convert.py", "gguf_reader.py", "quants.py", "generate.py", "model.py",
                  "engine/core.py", "core_client.py", "shm_broadcast.py", "run.c",
                  "src/llama-kv-cache.*", "llama-sampling.*"}
# Heads of GGUF metadata keys and tensor names, which read like dotted code but are not.
GGUF_HEADS = {"general", "tokenizer", "split", "powerinfer", "blk", "llama", "qwen2", "qwen3", "gemma3",
              "phi3", "falcon", "bamboo", "mistral", "attention"}

IDENT = r"[A-Za-z_]\w*"
FILE_EXT = r"(?:py|c|h|md|html|toml|json|txt|sh)"
# A path as docs write one: an optional folder part, a file name (globs allowed), an extension;
# or a folder of ours ending in '/'; or a file of ours with no extension (scripts/setup).
PATH_RE = re.compile(rf"^(?:[\w.*\-]+/)*[\w*\-][\w.*\-]*\.{FILE_EXT}(?:::\w+|:{IDENT})?$"
                     rf"|^(?:{'|'.join(map(re.escape, TOP))})/[\w.*\-/]*$")
DOTTED_RE = re.compile(rf"^{IDENT}(?:\.{IDENT})+$")
CLASSLIKE_RE = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
# A name after a file: an identifier, dotted or not, optionally called.
BOUND_NAME_RE = re.compile(rf"^({IDENT}(?:\.{IDENT})*)(?:\(.*\))?$")
# Between a file and the name it holds: spaces, a comma, a colon, a dash or an opening paren.
BOUND_SEP_RE = re.compile(r"^[\s,:(—–-]*$")


# ---------------------------------------------------------------------------------------------
# The repository: files, Python definitions, C definitions

@functools.lru_cache(maxsize=None)
def repo_files() -> tuple[str, ...]:
    """Every file of the working tree that git tracks or would track (new files of other work
    in progress included), as paths relative to the root."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
        files = [f for f in out if f and (ROOT / f).exists()]
    except (OSError, subprocess.CalledProcessError):  # no git: walk the tree
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not any(part.startswith(".") and part != ".ci" or part in
                                            ("build", "__pycache__") or part.endswith(".egg-info")
                                            for part in p.relative_to(ROOT).parts)]
    return tuple(sorted(files))


SELF = str(Path(__file__).resolve().relative_to(ROOT)) if Path(__file__).resolve().is_relative_to(ROOT) else ""


def python_files() -> list[str]:
    """The repository's Python, this test left out (its docstring names code as examples)."""
    return [f for f in repo_files() if f.endswith(".py") and f != SELF]


@functools.lru_cache(maxsize=None)
def parse(path: str) -> ast.Module | None:
    try:
        return ast.parse((ROOT / path).read_text(encoding="utf-8", errors="replace"), path)
    except (SyntaxError, OSError):
        return None


def _targets(node: ast.AST):
    """Names bound by an assignment target (a, b = ...; self.x, self.y = ...)."""
    if isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            yield from _targets(e)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _assigned(stmt: ast.stmt):
    if isinstance(stmt, ast.Assign):
        for t in stmt.targets:
            yield from _targets(t)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        yield stmt.target


def top_level_names(tree: ast.Module) -> set[str]:
    """What a module defines or imports at its top level (inside if/try blocks too)."""
    names: set[str] = set()

    def visit(body):
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for a in stmt.names:
                    names.add(a.asname or a.name.split(".")[0])
            elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, part, []))
                for h in getattr(stmt, "handlers", []):
                    visit(h.body)
            for t in _assigned(stmt):
                if isinstance(t, ast.Name):
                    names.add(t.id)
    visit(tree.body)
    return names


class ClassInfo:
    def __init__(self, path: str, node: ast.ClassDef):
        self.path, self.node = path, node
        self.bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                      for b in node.bases]
        members: set[str] = set()
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                members.add(stmt.name)
            for t in _assigned(stmt):
                if isinstance(t, ast.Name):
                    members.add(t.id)
        for fn in ast.walk(node):  # attributes the methods set: self.x = ..., self.x: T = ...
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args:
                me = fn.args.args[0].arg
                for stmt in ast.walk(fn):
                    for t in _assigned(stmt) if isinstance(stmt, ast.stmt) else ():
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                            members.add(t.attr)
        self.members = members


@functools.lru_cache(maxsize=None)
def classes() -> dict[str, list[ClassInfo]]:
    """Every class of the repository's Python, by name (a name may have several)."""
    out: dict[str, list[ClassInfo]] = {}
    for f in python_files():
        tree = parse(f)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(ClassInfo(f, node))
    return out


def class_has(name: str, member: str, seen: frozenset = frozenset()) -> bool:
    """Whether a class of ours called `name` (or one of its bases of ours) has `member`."""
    for c in classes().get(name, []):
        if member in c.members:
            return True
        if any(b not in seen and class_has(b, member, seen | {name}) for b in c.bases if b in classes()):
            return True
    return False


@functools.lru_cache(maxsize=None)
def python_names() -> frozenset[str]:
    """The names a class-like name the docs use alone may be: what the repository's Python
    defines (classes, functions, assignments), imports from other projects, or reaches as an
    attribute (`gguf.GGUFWriter`, `transformers.LlamaForCausalLM`). A name only imported from a
    module of ours is not one: a class renamed where it is defined leaves it stale."""
    names: set[str] = set()
    for f in python_files():
        tree = parse(f)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.stmt):
                names.update(t.id for t in _assigned(node) if isinstance(t, ast.Name))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] not in TOP:
                names.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def constants() -> frozenset[str]:
    """What a constant the docs name alone (`MAX_SMALL_BATCH`, `K_AHEAD`, `GGML_CPU_REPACK`) may
    be: a name the Python assigns or the C defines (a macro, an enum member, a constant), a word
    of the shell scripts and build files (another project's flags they set), or a constant of the
    system modules (`MADV_RANDOM`). Used alone elsewhere does not count: a constant renamed where
    it is defined leaves it stale."""
    names: set[str] = set()
    for f in repo_files():
        if f == SELF:
            continue
        if f.endswith(".py"):
            tree = parse(f)
            for node in ast.walk(tree) if tree else ():
                if isinstance(node, ast.stmt):
                    names.update(t.id for t in _assigned(node) if isinstance(t, ast.Name))
        elif f.endswith((".c", ".h")):
            text = c_text(f)
            names.update(re.findall(r"^\s*#\s*define\s+(\w+)", text, re.M))
            names.update(re.findall(r"^\s*([A-Z][A-Z0-9_]*)\s*(?:=[^,;]*)?,", text, re.M))  # enum members
            names.update(re.findall(r"\b([A-Z][A-Z0-9_]*)\s*(?:\[[^\]]*\])*\s*=", text))
        elif f.startswith(("scripts/", ".ci/")) or f.endswith((".toml", ".cfg", ".sh")):
            names.update(re.findall(r"\w+", (ROOT / f).read_text(encoding="utf-8", errors="replace")))
    import errno, mmap, os, resource, signal  # noqa: E401 (the system's constants)
    for mod in (errno, mmap, os, resource, signal):
        names.update(dir(mod))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, str]:
    """Dotted module name -> file, for our packages (a package is its __init__.py)."""
    out = {}
    for f in python_files():
        parts = f[:-3].split("/")
        if parts[0] not in PACKAGES:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


@functools.lru_cache(maxsize=None)
def short_modules() -> dict[str, list[str]]:
    """A module's last name -> its dotted names (`observe` -> coordinator.tools.observe)."""
    out: dict[str, list[str]] = {}
    for m in modules():
        out.setdefault(m.rsplit(".", 1)[-1], []).append(m)
    return out


C_DEF_PATTERNS = (
    r"^[A-Za-z_][\w \t\*]*?\b{n}\s*\([^;{{]*?\)\s*(?:__attribute__\s*\(\(.*?\)\)\s*)?\{{",  # a function
    r"^\s*#\s*define\s+{n}\b",  # a macro
    r"\bstruct\s+{n}\s*\{{", r"\}}\s*{n}\s*;",  # a struct, a typedef'd one
    r"^\s*(?:static\s+)?(?:const\s+)?[\w \t\*]+\b{n}\s*(?:\[[^\]]*\])*\s*=",  # a constant, a table
    r"^\s*{n}\s*(?:=[^,}}]*)?[,}}]",  # an enum member
)


@functools.lru_cache(maxsize=None)
def c_text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8", errors="replace")


def c_defines(path: str, name: str) -> bool:
    text = c_text(path)
    return any(re.search(p.format(n=re.escape(name)), text, re.M | re.S) for p in C_DEF_PATTERNS)


@functools.lru_cache(maxsize=None)
def kernel_functions() -> frozenset[str]:
    """The functions of the C module `_kernels` (python_module.c's method table)."""
    text = c_text("sparsecore/kernels/python_module.c")
    return frozenset(re.findall(r'\{\s*"(\w+)"\s*,\s*(?:\(PyCFunction\))?', text))


# ---------------------------------------------------------------------------------------------
# The docs: inline code spans, fenced blocks, links

def split_fences(text: str) -> tuple[str, list[str]]:
    """(the text with fenced blocks blanked out, line count kept; the fenced blocks)."""
    prose, fences, block, fence = [], [], [], None
    for line in text.split("\n"):
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence is None and m:
            fence, block = m.group(1), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            fences.append("\n".join(block))
            fence = None
            prose.append("")
        elif fence is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), fences


def code_spans(prose: str) -> list[tuple[int, int, str]]:
    """Inline code spans (start, end, content) as CommonMark reads them: a run of n backticks
    opens a span that the next run of exactly n closes; a span stays inside its paragraph."""
    spans = []
    for para in re.finditer(r"(?:[^\n]+\n?)+", prose):
        text, base, i = para.group(0), para.start(), 0
        while True:
            m = re.compile(r"`+").search(text, i)
            if not m:
                break
            tick = m.group(0)
            close = re.compile(rf"(?<!`){tick}(?!`)").search(text, m.end())
            if not close:
                i = m.end()
                continue
            body = text[m.end():close.start()].replace("\n", " ")
            if body.strip() and not (body.startswith(" ") and body.endswith(" ") and body.strip()):
                spans.append((base + m.start(), base + close.end(), body))
            elif body.strip():
                spans.append((base + m.start(), base + close.end(), body.strip()))
            i = close.end()
    return spans


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# ---------------------------------------------------------------------------------------------
# The checks

def ignored(path: str) -> bool:
    """Whether git ignores `path`: an output the docs name (the built kernels, a test's
    screenshot), which a clean checkout does not hold."""
    try:
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0
    except OSError:
        return False


def path_exists(path: str) -> bool:
    """A path named in the docs: a file or folder of ours (globs allowed); a path that is not
    under a top folder may be the tail of one (`tools/observe.py`, `engine_build.py`); an
    output git ignores counts as there."""
    return _path_exists(path) or ignored(path.split("::")[0])


def _path_exists(path: str) -> bool:
    path = path.split("::")[0]
    path = re.sub(rf":{IDENT}$", "", path)
    files = repo_files()
    if path.endswith("/"):
        d = path.rstrip("/")
        return (ROOT / d).is_dir() or any(f.startswith(path) for f in files) or any(
            f"/{path}" in f"/{x}" for x in files)
    anchored = path.split("/")[0] in TOP
    if "*" in path:
        pat = path if anchored else f"*{path}" if "/" in path else path
        return any(fnmatch.fnmatch(f if anchored or "/" in path else f.rsplit("/", 1)[-1], pat) for f in files)
    if anchored:
        return (ROOT / path).exists()
    return any(f == path or f.endswith("/" + path) for f in files)


def files_named(path: str) -> list[str]:
    """The repository's files a doc's file name stands for (a tail, a glob)."""
    path = path.split("::")[0]
    path = re.sub(rf":{IDENT}$", "", path)
    files = repo_files()
    if path.split("/")[0] in TOP:
        return [f for f in files if fnmatch.fnmatch(f, path)]
    return [f for f in files if fnmatch.fnmatch(f, path) or fnmatch.fnmatch(f, "*/" + path)]


def resolve_dotted(ref: str) -> str | None:
    """None where `ref` is fine or not ours; else why it is stale."""
    parts = ref.split(".")
    head = parts[0]
    if head in GGUF_HEADS:
        return None
    if head == "_kernels":
        return None if parts[1] in kernel_functions() else f"the C module _kernels has no {parts[1]}"
    if head in classes():
        if not class_has(head, parts[1]):
            return f"class {head} has no {parts[1]}"
        return None
    # the longest prefix that is a module of ours, by its full name or (unique) last name
    mods = modules()
    for k in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:k])
        full = [name] if name in mods else (short_modules().get(name, []) if k == 1 else [])
        if len(full) != 1:
            continue
        tree = parse(mods[full[0]])
        rest = parts[k:]
        if tree is None:
            return None
        if rest[0] not in top_level_names(tree):
            return f"module {full[0]} ({mods[full[0]]}) has no {rest[0]}"
        if len(rest) > 1 and rest[0] in classes() and not class_has(rest[0], rest[1]):
            return f"class {rest[0]} has no {rest[1]}"
        return None
    return None


def defines(path: str, name: str) -> bool:
    """Whether file `path` defines `name` (its first part, and a class's member after it)."""
    first, *rest = name.split(".")
    if path.endswith(".py"):
        tree = parse(path)
        if tree is None:
            return False
        if first not in top_level_names(tree):
            # a method named on its own after its file (`transformer.py:forward`)
            return not rest and any(first in c.members for cs in classes().values() for c in cs if c.path == path)
        return not rest or first not in classes() or class_has(first, rest[0])
    if path.endswith((".c", ".h")):
        return c_defines(path, first)
    return True


def check_doc(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    rel = doc.relative_to(ROOT)
    prose, fences = split_fences(text)
    spans = code_spans(prose)
    stale: list[str] = []

    def report(pos: int, what: str):
        stale.append(f"{rel}:{line_of(prose, pos)}: {what}")

    for k, (a, b, body) in enumerate(spans):
        token = body.strip()
        first_word = token.split()[0] if token.split() else ""
        # paths: the whole span or the command's first word (`scripts/x.py --flag`), or after
        # `python ` (`python scripts/x.py`)
        words = token.split()
        cands = [first_word] + ([words[1]] if first_word in ("python", "python3", "bash") and len(words) > 1 else [])
        for w in cands:
            w = w.rstrip(",;:")
            if PATH_RE.match(w) and w not in EXTERNAL_FILES:
                if not path_exists(w):
                    report(a, f"`{w}`: no such file or folder")
                elif re.search(r"\.(py|c|h)(?:::|:)", w):
                    fname, name = re.split(r"::|:(?=\w+$)", w, maxsplit=1)
                    if not any(defines(f, name) for f in files_named(fname)):
                        report(a, f"`{w}`: {fname} defines no {name}")
        # a name right after a file: `file.py` `Name.member`, `file.c` `function`
        m_path = re.fullmatch(rf"((?:[\w.*\-]+/)*[\w*\-][\w.*\-]*\.(?:py|c|h))", token)
        if m_path and k + 1 < len(spans) and token not in EXTERNAL_FILES:
            a2, _, body2 = spans[k + 1]
            m_name = BOUND_NAME_RE.match(body2.strip())
            if BOUND_SEP_RE.match(prose[b:a2]) and m_name and not PATH_RE.match(body2.strip()):
                name = m_name.group(1)
                files = files_named(token)
                if files and not any(defines(f, name) for f in files):
                    report(a2, f"`{token}` `{name}`: {', '.join(files)} defines no {name.split('.')[0]}"
                           + (f".{name.split('.', 1)[1]}" if "." in name else ""))
        # dotted references: `Class.member`, `module.name`, `_kernels.name`
        call = re.fullmatch(rf"({IDENT}(?:\.{IDENT})+)(?:\(.*\))?", token)
        if call and not PATH_RE.match(token):
            why = resolve_dotted(call.group(1))
            if why:
                report(a, f"`{token}`: {why}")
        # a constant alone: CAPS_WITH_UNDERSCORES
        if re.fullmatch(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+", token) and token not in constants():
            report(a, f"`{token}`: no code of ours defines {token}")
        # a class-like name alone
        m_cls = re.fullmatch(r"(_?[A-Z]\w*)(?:\(.*\))?", token)
        if m_cls and CLASSLIKE_RE.match(m_cls.group(1)) and m_cls.group(1) not in python_names():
            report(a, f"`{token}`: the code has no {m_cls.group(1)}")

    # paths of ours written as plain words in the prose (outside code spans and link targets)
    plain = list(prose)
    for a, b, _ in spans:
        plain[a:b] = " " * (b - a)
    plain = re.sub(r"\]\([^)]*\)", lambda m: " " * len(m.group(0)), "".join(plain))
    for m in re.finditer(rf"(?<![\w/.\-])((?:{'|'.join(map(re.escape, TOP))})/[\w./\-]*\.{FILE_EXT})\b", plain):
        if not path_exists(m.group(1)):
            report(m.start(), f"{m.group(1)}: no such file")

    # fenced blocks (diagrams, commands): paths of ours and Class.member of our classes
    fence_at = [m.start() for m in re.finditer(r"(?m)^\s*(`{3,}|~{3,})", text)][0::2]
    for start, block in zip(fence_at, fences):
        for m in re.finditer(rf"(?<![\w/.\-])((?:{'|'.join(map(re.escape, TOP))})/[\w./*\-]*\w)", block):
            if not path_exists(m.group(1)):
                stale.append(f"{rel}:{line_of(text, start) + 1 + block.count(chr(10), 0, m.start())}: "
                             f"`{m.group(1)}` (in a code block): no such file or folder")
        for m in re.finditer(rf"(?<![\w.])([A-Z]\w*)\.({IDENT})", block):
            if m.group(1) in classes() and not class_has(m.group(1), m.group(2)):
                stale.append(f"{rel}:{line_of(text, start) + 1 + block.count(chr(10), 0, m.start())}: "
                             f"{m.group(0)} (in a code block): class {m.group(1)} has no {m.group(2)}")
    return stale


def test_docs_name_code_that_exists():
    stale = [s for doc in DOCS for s in check_doc(doc)]
    assert not stale, ("the docs name code that does not exist (fix the sentence, or the code):\n  "
                       + "\n  ".join(stale))


# ---------------------------------------------------------------------------------------------
# Links between the pages

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, inline markup dropped, punctuation but '-'
    and '_' removed, spaces to '-'."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    h = h.replace("`", "").strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"(?m)^#{1,6}\s+(.*?)\s*#*\s*$", prose):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    out.update(re.findall(r'<a\s+(?:name|id)="([^"]+)"', prose))
    return frozenset(out)


def check_links(doc: Path) -> list[str]:
    prose, _ = split_fences(doc.read_text(encoding="utf-8"))
    spans = code_spans(prose)
    in_code = lambda p: any(a <= p < b for a, b, _ in spans)  # noqa: E731
    bad = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", prose):
        target = m.group(1)
        if in_code(m.start()) or re.match(r"^[a-z]+:", target):  # http:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        where = f"{doc.relative_to(ROOT)}:{line_of(prose, m.start())}"
        if not dest.exists():
            bad.append(f"{where}: ({target}): no file {file}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: ({target}): {dest.relative_to(ROOT)} has no heading #{anchor}")
    return bad


def test_links_between_pages_resolve():
    bad = [s for doc in DOCS for s in check_links(doc)]
    assert not bad, "links that lead nowhere:\n  " + "\n  ".join(bad)
