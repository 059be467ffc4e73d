"""No module of the package calls a torch.distributed collective directly: they all go through
``areal_cli.utils.collectives``, which moves each tensor to a device its group serves (a host tensor
on an NCCL-only group fails there otherwise, and only on GPU clusters, where tests do not run).

The walk is static (``ast``): a call ``X.<collective>(...)`` where ``X`` is ``torch.distributed`` or a
name bound to it (``import torch.distributed as dist``, ``from torch import distributed``), and any
``from torch.distributed[...] import <collective>``. Methods of a bare process group (``pg.broadcast``,
the weight-update group) are not torch.distributed calls and are left alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "areal_cli"
HELPERS = PKG / "utils" / "collectives.py"

COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "barrier", "monitored_barrier",
})
_TORCH_DIST = ("torch.distributed", "torch.distributed.distributed_c10d")


def _dist_aliases(tree: ast.AST) -> set[str]:
    """The dotted names that mean torch.distributed in this module."""
    names = set(_TORCH_DIST)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.name in _TORCH_DIST and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names.update(a.asname or a.name for a in node.names if a.name == "distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names.update(a.asname or a.name for a in node.names if a.name == "distributed_c10d")
    return names


def direct_collectives(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: call`` for every direct torch.distributed collective in ``source``."""
    tree = ast.parse(source, filename=filename)
    aliases = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES and ast.unparse(node.func.value) in aliases):
            found.append((node.lineno, f"{ast.unparse(node.func)}(...)"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if a.name in COLLECTIVES]
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def test_no_direct_collective_in_the_package():
    files = [p for p in sorted(PKG.rglob("*.py")) if p != HELPERS]
    assert any(p.match("engines/archon/*.py") for p in files) and any(p.match("weight_sync/*.py") for p in files)
    found = [hit for p in files for hit in direct_collectives(p.read_text(), str(p.relative_to(PKG)))]
    assert not found, "use areal_cli.utils.collectives instead of:\n" + "\n".join(found)


def test_the_lint_flags_every_spelling():
    """The checker itself: each way of reaching a collective is caught; look-alikes are not."""
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "import torch.distributed as td\n"
        "from torch import distributed\n"
        "from torch.distributed import all_gather_object as ago\n"
        "def f(t, pg, opts):\n"
        "    dist.all_reduce(t)\n"
        "    td.barrier()\n"
        "    distributed.send(t, dst=0)\n"
        "    torch.distributed.broadcast(t, src=0)\n"
        "    torch.distributed.distributed_c10d.all_to_all_single(t, t)\n"
        "    dist.get_rank(); dist.get_global_rank(pg, 0); dist.ReduceOp.SUM\n"
        "    pg.broadcast([t], opts).wait()\n"
        "    collectives.all_reduce(t)\n"
    )
    found = direct_collectives(source)
    assert [h.split(": ", 1)[1] for h in found] == [
        "from torch.distributed import all_gather_object",
        "dist.all_reduce(...)",
        "td.barrier(...)",
        "distributed.send(...)",
        "torch.distributed.broadcast(...)",
        "torch.distributed.distributed_c10d.all_to_all_single(...)",
    ], found


def test_the_helpers_module_covers_what_the_package_used():
    """Every collective the package needs has a helper of the same name (the lint points there)."""
    from areal_cli.utils import collectives

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                 "all_to_all_single", "send", "recv", "barrier", "broadcast_object_list", "all_gather_object",
                 "gather_object", "scatter_object_list", "send_object_list", "recv_object_list"):
        assert callable(getattr(collectives, name)), name
