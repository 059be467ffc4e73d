"""The package's import graph has no cycle, and the CLI stays torch-free at import time.

The walk is static (``ast``): every ``import``/``from`` statement of every module under
``src/areal_cli``, resolved to the package's own modules (``from pkg import name`` is an edge to the
module ``pkg.name`` when that is a module, else to ``pkg``). Function-level (lazy) imports count as
well: a lazy import only changes *when* a module is loaded, not that two modules need each other, and
the layout keeps one direction between folders (docs/architecture.md, "Layout"). Imports under
``if TYPE_CHECKING:`` never run and are left out. Parent packages are not added as edges: importing
``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, but they are already in ``sys.modules``
when a sibling is loaded from inside them, so that is not a cycle Python trips over.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def package_modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file of ``package`` under ``src``."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``pkg.mod.attr`` → ``pkg.mod``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [t for a in node.names if (t := _owner(a.name, modules))]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        pkg = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    out = []
    for a in node.names:
        full = f"{base}.{a.name}"
        t = full if full in modules else _owner(base, modules)
        if t:
            out.append(t)
    return out


def import_graph(src: Path, package: str, *, lazy: bool = True) -> dict[str, set[str]]:
    """module → the package modules it imports (module-level only with ``lazy=False``)."""
    modules = package_modules(src, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}

    def walk(module: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (lazy or not inner):
                graph[module].update(t for t in _targets(module, child, modules) if t != module)
            walk(module, child, inner)

    for module, path in modules.items():
        walk(module, ast.parse(path.read_text(), filename=str(path)), False)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_cycle_in_the_package():
    graph = import_graph(SRC, "areal_cli")
    assert len(graph) > 100 and graph["areal_cli.trainer.rl"], "the walk found the package's modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (lazy imports included): " + " -> ".join(cycle)


def test_the_walk_sees_lazy_relative_and_from_imports(tmp_path):
    """The checker itself: a cycle made only of a lazy import and a relative one is found; one that
    goes through ``if TYPE_CHECKING:`` is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from .. import c\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\nimport pkg.a as a\n",
        "d.py": "import pkg.c\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(textwrap.dedent(text))
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert find_cycle(import_graph(tmp_path, "pkg", lazy=False)) is None


def test_cli_imports_no_torch():
    code = ("import sys, areal_cli.cli.main, areal_cli.cli.train, areal_cli.cli.launch, areal_cli.cli.report\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
