"""Config import targets checked from the module's source, without running it (utils/static_import.py)."""

from __future__ import annotations

import ast
import sys

import pytest

from areal_cli.errors import ConfigError
from areal_cli.utils.static_import import UNDECIDED, find_target, is_sync_function, parameters, split_target

SOURCE = '''
import os, no_such_dependency_anywhere
from json import dumps as to_json
try:
    import fast_thing as impl
except ImportError:
    impl = None
if os.name == "posix":
    def posix_only(): ...
RATE, (A, B) = 1, (2, 3)
counter: int = 0

class Workflow:
    def __init__(self, reward_fn, gconfig, *, temperature=1.0, style="a"):
        ...

class Open:
    def __init__(self, x, **extra): ...

class Inherits(Workflow):
    async def __call__(self, client, data): ...

class SyncCall:
    def __call__(self, client, data): ...

async def agent(client, data): ...
def plain(client, data): ...
'''


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "userpkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "mod.py").write_text(SOURCE)
    (root / "star.py").write_text("from os.path import *\n")
    (root / "lazy.py").write_text("def __getattr__(name): ...\n")
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userpkg.sub.mod"
    for name in [m for m in sys.modules if m.startswith(("userpkg", "brokenpkg"))]:
        del sys.modules[name]


def test_split_target():
    assert split_target("a.b:C.d") == ("a.b", "C.d") and split_target("a.b.C") == ("a.b", "C")
    assert split_target("plain") == ("", "plain")


def test_names_bound_anywhere_at_module_level(pkg):
    for name in ("to_json", "impl", "posix_only", "RATE", "A", "B", "counter", "Workflow", "agent"):
        assert find_target(f"{pkg}:{name}", "k") is not UNDECIDED, name
    assert isinstance(find_target(f"{pkg}.Workflow", "k"), ast.ClassDef)
    assert isinstance(find_target(f"{pkg}:Workflow.method", "k"), ast.ClassDef)  # the first part is checked
    assert pkg not in sys.modules  # read, not imported (it imports a module that does not exist)


def test_missing_attribute_and_module(pkg):
    with pytest.raises(ConfigError) as e:
        find_target(f"{pkg}:agnet", "workflow.kwargs.agent")
    assert e.value.path == "workflow.kwargs.agent" and e.value.hint.startswith("did you mean 'agent'?")
    with pytest.raises(ConfigError, match="no module named 'userpkg.sub.mdo'") as e:
        find_target("userpkg.sub.mdo:agent", "k")
    assert "did you mean 'mod'?" in e.value.hint
    with pytest.raises(ConfigError, match="no module named 'nopkg_xyz'"):
        find_target("nopkg_xyz.mod:f", "k")
    with pytest.raises(ConfigError, match="boom at import"):
        find_target("brokenpkg.mod:f", "k")
    with pytest.raises(ConfigError, match="not an import path"):
        find_target("justaname", "k")


def test_dynamic_modules_are_left_to_the_run(pkg):
    assert find_target("userpkg.star:anything", "k") is UNDECIDED
    assert find_target("userpkg.lazy:anything", "k") is UNDECIDED


def test_an_imported_module_is_asked_directly():
    assert find_target("json:dumps", "k") is sys.modules["json"].dumps
    with pytest.raises(ConfigError, match=r"did you mean 'dumps?'\?"):
        find_target("json:dumpz", "k")


def test_parameters_and_sync_functions(pkg):
    def get(name):
        return find_target(f"{pkg}:{name}", "k")

    assert parameters(get("Workflow")) == (["reward_fn", "gconfig", "temperature", "style"], False)
    assert parameters(get("Open")) == (["x"], True)
    assert parameters(get("Inherits")) is None  # its __init__ is inherited: the source alone cannot tell
    assert parameters(get("plain")) == (["client", "data"], False)
    assert parameters(UNDECIDED) is None

    def f(a, *, b=1, **kw): ...

    assert parameters(f) == (["a", "b"], True)
    assert is_sync_function(get("plain")) and is_sync_function(get("SyncCall"))
    assert not is_sync_function(get("agent")) and not is_sync_function(get("Inherits"))
    assert not is_sync_function(get("RATE"))
