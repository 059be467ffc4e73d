"""The package's folders depend one way, its import graph has no cycle, and the CLI stays torch-free.

The walk is static (``ast``): every ``import``/``from`` statement of every module under
``src/areal_cli``, resolved to the package's own modules (``from pkg import name`` is an edge to the
module ``pkg.name`` when that is a module, else to ``pkg``). Function-level (lazy) imports count as
well: a lazy import only changes *when* a module is loaded, not that two modules need each other.
Imports under ``if TYPE_CHECKING:`` never run and are left out. Parent packages are not added as
edges: importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, but they are already in
``sys.modules`` when a sibling is loaded from inside them, so that is not a cycle Python trips over.

docs/architecture.md, "Layout", lists the folders in their order; a module may import only from its
own folder, from folders above it in that table, and from ``errors.py`` and ``registry.py``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ARCHITECTURE = SRC.parent / "docs" / "architecture.md"


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


def folder_imports(src: Path, package: str) -> dict[str, set[str]]:
    """Folder (or top-level module, as ``registry.py``) → the others it imports, ``errors.py`` left out."""
    def folder(module: str) -> str | None:
        parts = module.split(".")
        if len(parts) == 1:
            return None
        return parts[1] if (src / package / parts[1]).is_dir() else parts[1] + ".py"

    out: dict[str, set[str]] = {}
    for module, targets in import_graph(src, package).items():
        a = folder(module)
        if a is None:
            continue
        out.setdefault(a, set()).update(b for t in targets if (b := folder(t)) not in (None, a, "errors.py"))
    return out


FLOOR = ("errors.py", "registry.py")  # below every folder; registry.py imports errors.py only


def layout_table(text: str) -> list[tuple[str, set[str]]]:
    """docs/architecture.md's "Layout" table: (folder, the folders its "imports" column names), in order."""
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)/` \|.*\| ([^|]*) \|$", layout, flags=re.MULTILINE)
    return [(name, set(re.findall(r"`([\w.]+)`", cell))) for name, cell in rows]


def upward_imports(src: Path, package: str, order: list[str]) -> list[str]:
    """Every import that goes up ``order`` (or out of it), as "a.b imports c.d: `x/` is above `y/`"."""
    rank = {f: i for i, f in enumerate(order)}
    for i, f in enumerate(FLOOR):
        rank[f] = -len(FLOOR) + i
    modules = package_modules(src, package)

    def folder(module: str) -> str | None:
        parts = module.split(".")
        if len(parts) == 1:
            return None
        return parts[1] if (src / package / parts[1]).is_dir() else parts[1] + ".py"

    bad = []
    for module, targets in sorted(import_graph(src, package).items()):
        a = folder(module)
        for target in sorted(targets):
            b = folder(target)
            if a is None or b is None or a == b:
                continue
            if a not in rank or b not in rank:
                missing = a if a not in rank else b
                bad.append(f"{module} imports {target}: `{missing}` has no place in the folder order")
            elif rank[b] > rank[a]:
                bad.append(f"{module} imports {target}: `{b}/` is above `{a}/` in the folder order "
                           f"({modules[module].relative_to(src)})")
    return bad


def test_folders_import_only_downward():
    """No import goes up the folder order of docs/architecture.md (lazy ones included)."""
    order = [name for name, _ in layout_table(ARCHITECTURE.read_text())]
    assert len(order) > 15 and order[0] == "utils" and order[-1] == "cli"
    bad = upward_imports(SRC, "areal_cli", order)
    assert not bad, "imports against the folder order:\n" + "\n".join(bad)


def test_a_planted_upward_import_fails_with_its_name(tmp_path):
    """The check itself, on a copy of the package with one lazy import going up: a function in
    `config/` importing the trainer. The message names both modules and the file."""
    import shutil

    shutil.copytree(SRC / "areal_cli", tmp_path / "areal_cli", ignore=shutil.ignore_patterns("__pycache__"))
    victim = tmp_path / "areal_cli" / "config" / "model.py"
    victim.write_text(victim.read_text() + "\n\ndef _planted():\n    from areal_cli.trainer import rl  # noqa\n")
    order = [name for name, _ in layout_table(ARCHITECTURE.read_text())]
    bad = upward_imports(tmp_path, "areal_cli", order)
    print("\n".join(bad))
    assert bad == ["areal_cli.config.model imports areal_cli.trainer.rl: `trainer/` is above `config/` in the "
                   "folder order (areal_cli/config/model.py)"]
    assert upward_imports(SRC, "areal_cli", order) == []


def test_architecture_layout_table_is_the_import_graph():
    """docs/architecture.md's folder table names every folder and exactly the folders each imports:
    a new import across folders updates the doc."""
    doc = dict(layout_table(ARCHITECTURE.read_text()))
    real = {f: deps for f, deps in folder_imports(SRC, "areal_cli").items() if not f.endswith(".py")}
    assert set(real) <= set(doc), f"folders missing from the table: {sorted(set(real) - set(doc))}"
    assert set(doc) - set(real) <= {"conf"}, f"table rows with no such package: {sorted(set(doc) - set(real))}"
    wrong = {f: {"doc": sorted(doc[f]), "code": sorted(real[f])} for f in real if doc[f] != real[f]}
    assert not wrong, f"architecture.md's 'imports' column differs from the code: {wrong}"
