"""The test suite's own rules, checked statically (ast) over every Python file in tests/:

1. No test module imports another test module (`tests.test_x`, `from .test_x import`, `from
   tests import test_x`): what tests share lives in tests/fixtures/ or conftest.py.
2. No test or fixture reaches a private name of other code: an attribute `obj._name` (one
   leading underscore, not a dunder) of anything but self, cls or super(); `from m import _name`
   or a private module in an import's path; a keyword argument `_name=`; a private name passed
   as a string to getattr/setattr/delattr/hasattr or monkeypatch's setattr/delattr (`"_name"`,
   `"pkg.mod._name"`). A module's own classes are its own: attributes and methods it defines
   itself (`self._count = 0`, `def _tick(self)`) may be read from their instances there.

Each finding names file, line and what it reached; ALLOWED lists the exceptions, each with its
reason (an entry that no longer matches anything fails too, so the list stays small).
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# (file relative to the repository, what it reaches as a finding spells it) -> why it stays
ALLOWED = {
    ("tests/test_wake_pipe.py", "os._exit"):
        "os._exit is the os module's documented API (the underscore says 'no clean-up', not "
        "'private'): a forked child must leave without running pytest's atexit handlers",
    ("tests/fixtures/mock_worker.py", "os._exit"):
        "os._exit, documented: the mock worker dies abruptly as a crashed worker does",
}

INTROSPECTION = {"getattr", "setattr", "delattr", "hasattr"}  # builtins; monkeypatch's setattr/delattr too


def private(name: str) -> bool:
    """One leading underscore (or a mangled __name), not a dunder, not `_` alone."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.AST) -> set[str]:
    """Attribute and method names the module's own classes define: methods and class-level names
    in a class body, and attributes assigned on self/cls anywhere."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
    return own


def _own_parameters(tree: ast.AST) -> set[str]:
    """Parameter names of the functions the module defines (its own helpers' keywords)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            out.update(p.arg for p in a.posonlyargs + a.args + a.kwonlyargs)
    return out


def _test_module_path(parts: list[str], relative: bool) -> bool:
    """A dotted path to a test module: a test_* part, within tests/ (or relative to the importer,
    or a top-level test_x as pytest's rootdir import would find it)."""
    return (relative or parts[0] == "tests" or len(parts) == 1) and any(p.startswith("test_") for p in parts)


def import_findings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each import of a test module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names
                    if _test_module_path(a.name.split("."), False)]
        elif isinstance(node, ast.ImportFrom):
            parts, relative = (node.module or "").split("."), node.level > 0
            module = "." * node.level + (node.module or "")
            if node.module and _test_module_path(parts, relative):
                out.append((node.lineno, f"from {module} import ..."))
            elif relative or parts[0] == "tests":  # a package of tests: its test_* modules by name
                out += [(node.lineno, f"from {module} import {a.name}") for a in node.names
                        if a.name.startswith("test_")]
    return sorted(out, key=lambda f: f[0])


def _dotted_private(text: str) -> bool:
    return all(p.isidentifier() for p in text.split(".")) and any(private(p) for p in text.split("."))


def private_findings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each private name of other code the module reaches."""
    own, params, out = _own_names(tree), _own_parameters(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if node.attr in own:
                continue
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if any(private(p) for p in module.split(".")):
                out.append((node.lineno, f"from {module} import ..."))
            out += [(node.lineno, f"from {module} import {a.name}") for a in node.names if private(a.name)]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if _dotted_private(a.name)]
        elif isinstance(node, ast.Call):
            out += [(node.lineno, f"{k.arg}=") for k in node.keywords
                    if k.arg and private(k.arg) and k.arg not in params]
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in INTROSPECTION:
                for arg in node.args[:2]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and \
                            _dotted_private(arg.value) and arg.value.split(".")[-1] not in own:
                        out.append((node.lineno, f"{name}(..., {arg.value!r})"))
    return sorted(out, key=lambda f: f[0])  # in line order (ast.walk goes breadth first)


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _report(kind: str, findings: list[tuple[Path, int, str]]) -> str:
    return f"{kind}:\n" + "\n".join(f"  {p.relative_to(REPO)}:{line}: {what}" for p, line, what in findings)


def _all(check) -> list[tuple[Path, int, str]]:
    out = []
    for path in _python_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        out += [(path, line, what) for line, what in check(tree)]
    return out


def test_no_test_module_imports_another():
    found = _all(import_findings)
    assert not found, _report("test modules importing test modules (share through tests/fixtures/ or "
                              "conftest.py instead)", found)


def test_no_test_reaches_a_private_name():
    found = [(p, line, what) for p, line, what in _all(private_findings)
             if (str(p.relative_to(REPO)), what) not in ALLOWED]
    assert not found, _report("private names of other code reached (test public behaviour, or give "
                              "the thing a public name; an exception goes in ALLOWED with its reason)", found)


def test_every_allowance_is_still_needed():
    reached = {(str(p.relative_to(REPO)), what) for p, _, what in _all(private_findings)}
    stale = sorted(set(ALLOWED) - reached)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


CAUGHT = '''
import tests.test_a
from tests.test_b import helper
from tests import test_c
from .test_d import x
from . import test_e
from sparsecore.gguf_file import _OPENED
from sparsecore.kernels._kernels import op
import sparsecore.kernels._kernels
def test_it(part, mp, mod):
    part._ptrs = 1
    part._exchange(1)
    mod.__secret
    write(path, _override=1)
    mp.setattr(mod, "_download", None)
    mp.setattr("coordinator.runtime.model_fetch._pull", None)
    getattr(part, "_skip")
'''

PASSED = '''
from tests.fixtures.tiny_gguf import encode
from tests.conftest import REPO
from tests.fixtures import procs
from . import conftest
import tests.fixtures.procs
class Clock:
    def __init__(self):
        self._t = 0
    def _tick(self):
        return self._t + super()._base()
def helper(x, _depth=0):
    return helper(x, _depth=_depth + 1)
def test_it(mod):
    c = Clock()
    c._t, c._tick(), mod.__name__, mod.__dict__
    getattr(c, "_t"), getattr(mod, "name")
'''


def test_the_checks_catch_what_they_name():
    """Positive and negative controls: each form the docstring names is found, with its line;
    a module's own names, dunders and public imports are not."""
    tree = ast.parse(CAUGHT)
    assert [line for line, _ in import_findings(tree)] == [2, 3, 4, 5, 6]
    assert [what for _, what in private_findings(tree)] == [
        "from sparsecore.gguf_file import _OPENED", "from sparsecore.kernels._kernels import ...",
        "import sparsecore.kernels._kernels", "part._ptrs", "part._exchange", "mod.__secret", "_override=",
        "setattr(..., '_download')", "setattr(..., 'coordinator.runtime.model_fetch._pull')", "getattr(..., '_skip')"]
    assert [line for line, _ in private_findings(tree)] == [7, 8, 9, 11, 12, 13, 14, 15, 16, 17]
    clean = ast.parse(PASSED)
    assert import_findings(clean) == [] and private_findings(clean) == []
