"""The layering docs/design.md describes, held by a test: which package may import which, no
training process pulls in the build's decoders, no import cycle, and importing a module changes
nothing of the importer's environment. And the sizes: no module over 450 lines, no function over 80.

Imports are read from the source (ast), those inside functions included: a lazy import is still
a dependency. Only `if TYPE_CHECKING:` blocks are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("packer", "loaders", "bench")
# what `loaders` may take from `packer` (docs/design.md, "Data flow"): the format and reader, object
# storage, the one error hierarchy, and the cores a process may use
LOADERS_MAY_IMPORT = ("packer.dataset", "packer.remote", "packer.errors", "packer.system")
DECODERS = ("PIL", "tokenizers", "pyarrow")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            continue
        yield node
        yield from _walk(node)


def imports_of(name: str) -> set[str]:
    """Every module `name` imports (by its full name; `from pkg import mod` as pkg.mod where that
    is a module of ours)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _offenders(sources: str, rule) -> list[str]:
    return sorted(f"{m} imports {i}" for m, deps in GRAPH.items() if _within(m, sources) for i in deps if rule(i))


def test_the_format_side_imports_nothing_of_the_build_the_store_or_the_command():
    assert _offenders("packer.dataset", lambda i: any(_within(i, p) for p in (
        "packer.builder", "packer.remote", "packer.api", "packer.cli", "loaders", "bench", "torch"))) == []


def test_object_storage_imports_the_format_and_never_the_build():
    assert _offenders("packer.remote", lambda i: any(_within(i, p) for p in (
        "packer.builder", "packer.api", "packer.cli", "loaders", "bench", "torch"))) == []


def test_packer_never_imports_torch_the_loaders_or_the_bench():
    assert _offenders("packer", lambda i: any(_within(i, p) for p in ("torch", "loaders", "bench"))) == []


def test_loaders_take_from_packer_only_the_reading_side():
    assert _offenders("loaders", lambda i: _within(i, "packer") and not any(
        _within(i, p) for p in LOADERS_MAY_IMPORT)) == []


def test_inside_loaders_the_batch_and_the_order_layers_import_neither_each_other_nor_the_views():
    assert _offenders("loaders.batch", lambda i: _within(i, "loaders.order") or _within(i, "loaders.views")) == []
    assert _offenders("loaders.order", lambda i: _within(i, "loaders.batch") or _within(i, "loaders.views")) == []


def test_no_module_of_loaders_imports_a_decoder():
    assert _offenders("loaders", lambda i: any(_within(i, d) for d in DECODERS)) == []
    code = "import sys, loaders, loaders.augment; print(*sorted(m for m in sys.modules if m.split('.')[0] in %r))"
    out = subprocess.run([sys.executable, "-c", code % (DECODERS,)], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    assert out == []


def _cycle() -> list[str] | None:
    ours = {m: {i for i in deps if i in GRAPH and i != m} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(ours[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None
    for m in sorted(ours):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle() is None


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_a_module_changes_no_environment_variable(package):
    """Worker processes set their own (OpenBLAS's threads, Rayon's); an import sets nothing.
    `packer._one_blas_thread` is the exception by its purpose: only the command's process
    (`packer.__main__`) and the pool's forkserver import it, before numpy."""
    names = [m for m in MODULES if _within(m, package) and not m.endswith(("__main__", "._one_blas_thread"))]
    code = ("import importlib, os, sys; before = dict(os.environ)\n"
            "for name in sys.argv[1:]:\n    importlib.import_module(name)\n"
            "print(sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)))")
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    assert _offenders(package, lambda i: i == "packer._one_blas_thread") == (
        ["packer.__main__ imports packer._one_blas_thread"] if package == "packer" else [])


MAX_LINES = 450  # a module past this holds more than one concept (shared/STYLE.md, "Sizes")


def test_no_module_is_over_450_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


MAX_FUNCTION_LINES = 80  # a function past this does more than one thing (issue 65, shared/STYLE.md "Sizes")
FUNCTION_DIRS = (*PACKAGES, "scripts")


def long_functions(bound: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method in packer/, loaders/, bench/ and scripts/ longer than `bound` lines
    (from its `def`, decorators not counted, to its last line), as 'path:line name (N lines)'."""
    found = []
    for top in FUNCTION_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > bound:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_is_over_80_lines():
    long = long_functions()
    assert long == [], f"split by concept (one function per mode, row kind, subcommand): {long}"


# private names another library defines that one bridge of ours reads (not ours to make public)
FOREIGN_PRIVATE = {("packer/internals.py", "_file")}  # soundfile's SoundFile: libsndfile's handle


def private_reads() -> list[str]:
    """Every read in packer/ or loaders/ of a private name (`_x`) that another of their modules
    defines: `obj._x` where obj is not self or cls and `_x` is not defined in the reading module,
    and `from ours import _x` of a name (a module such as `packer._one_blas_thread` is imported,
    not read). A seam read this way is one a change on the other side breaks unseen (issue 65:
    five modules read the cache's private fields)."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for top in ("packer", "loaders")
             for p in sorted((ROOT / top).rglob("*.py"))}

    def defined(tree) -> set[str]:
        out = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
        return {d for d in out if d.startswith("_") and not d.startswith("__")}
    own = {p: defined(t) for p, t in trees.items()}
    ours = set().union(*own.values())
    found = []
    for path, tree in trees.items():
        where = str(path.relative_to(ROOT))
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in ours and n.attr not in own[path] and \
                    (where, n.attr) not in FOREIGN_PRIVATE and \
                    not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                found.append(f"{where}:{n.lineno} {ast.unparse(n)}")
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in PACKAGES:
                found += [f"{where}:{n.lineno} from {n.module} import {a.name}" for a in n.names
                          if a.name.startswith("_") and not a.name.startswith("__") and
                          f"{n.module}.{a.name}" not in MODULES]
    return found


def test_no_module_of_packer_or_loaders_reads_another_ones_private_names():
    assert private_reads() == [], "give the other side a public name for what is read (a method, a property)"
