"""The package's house rules, read from the source (``ast``): where code lives and how big it is.

docs/design.md draws the layout these keep: one folder per concern, only ``copy/`` talks to
the compiled core, no layer reaches into another's internals, the bench and the test bed
stay out of the wheel, every class name means one thing, functions fit on a screen and
docstrings say what and why.
"""

from __future__ import annotations

import ast
import logging
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import lmcache_kv_fast
from lmcache_kv_fast import cli

ROOT = Path(lmcache_kv_fast.__file__).resolve().parent
PKG = "lmcache_kv_fast"
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 30
MAX_MODULE_LINES = 600


def _modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PKG, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path, ast.parse(path.read_text(encoding="utf-8"))


MODULES = list(_modules())


def _imports(tree: ast.Module) -> Iterator[tuple[ast.AST, str, list[str]]]:
    """``(node, module, names)`` of every absolute import (``import x`` gives names [])."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node, node.module, [a.name for a in node.names]


def _private_part(dotted: str) -> str | None:
    """The dotted prefix up to the first ``_private`` part after the package name, if any."""
    parts = dotted.split(".")
    for i, part in enumerate(parts[1:], 1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_only_copy_imports_the_native_core():
    bad = [mod for mod, _, tree in MODULES for _, m, names in _imports(tree)
           if (m == f"{PKG}._native" or (m == PKG and "_native" in names))
           and not mod.startswith(f"{PKG}.copy.")]
    assert bad == []


def test_no_sys_modules_lookups():
    bad = [f"{mod}:{n.lineno}" for mod, _, tree in MODULES for n in ast.walk(tree)
           if isinstance(n, ast.Attribute) and n.attr == "modules"
           and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert bad == []


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _internals(mod: str, m: str, names: list[str]) -> Iterator[str]:
    """What of another module's internals ``from m import names`` (in ``mod``) reaches."""
    for target in [m, *(f"{m}.{n}" for n in names if _is_module(f"{m}.{n}"))]:
        owner = _private_part(target)  # the package a _private module belongs to
        if owner and target != f"{PKG}._native" and not (mod == owner or mod.startswith(owner + ".")):
            yield f"the private module {target}"
    for n in names:
        if n.startswith("_") and not n.startswith("__") and n != "_native" and not _is_module(f"{m}.{n}"):
            yield f"the internal name {m}.{n}"


def test_nothing_imports_another_modules_internals():
    """A ``_private`` module is imported only inside its package; a ``_name`` only by its module."""
    bad = [f"{mod}:{node.lineno} imports {what}" for mod, _, tree in MODULES
           for node, m, names in _imports(tree) if m.startswith(PKG + ".") or m == PKG
           for what in _internals(mod, m, names)]
    assert bad == []


def test_the_bench_and_the_test_bed_stay_out_of_the_package():
    """Nothing in the wheel imports them; only ``cli bench`` looks for the checkout's harness."""
    bad = [f"{mod}:{node.lineno}" for mod, _, tree in MODULES for node, m, _ in _imports(tree)
           if m.split(".")[0] in ("benches", "testbed") and mod != f"{PKG}.cli"]
    assert bad == []
    assert sorted(p.name for p in (ROOT / "testing").iterdir() if p.suffix == ".py") == [
        "__init__.py", "logtail.py", "register.py", "server.py"]
    assert not (ROOT / "testing" / "bench").exists()
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert [m for m in top if m.startswith(("batch_", "rewrite_", "edit_"))] == []


def test_each_class_name_means_one_thing():
    where: dict[str, set[str]] = defaultdict(set)
    for mod, _, tree in MODULES:
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                where[n.name].add(mod)
    assert {k: sorted(v) for k, v in where.items() if len(v) > 1} == {}


def test_functions_fit_on_a_screen():
    bad = [f"{mod}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
           for mod, _, tree in MODULES for n in ast.walk(tree)
           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
           and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert bad == []


def test_docstrings_say_what_and_why_briefly():
    bad = []
    for mod, _, tree in MODULES:
        for n in [tree, *ast.walk(tree)]:
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(n, clean=False)
                if doc is not None and doc.count("\n") + 1 > MAX_DOCSTRING_LINES:
                    bad.append(f"{mod}:{getattr(n, 'lineno', 1)} {getattr(n, 'name', '<module>')}")
    assert sorted(set(bad)) == []


def test_modules_stay_small():
    bad = [f"{mod} ({n} lines)" for mod, path, _ in MODULES
           if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert bad == []


def test_cli_bench_outside_a_checkout_says_how_to_get_it(monkeypatch, caplog):
    """An installed wheel has no harness: ``bench`` says where it is instead of a traceback."""
    monkeypatch.setitem(sys.modules, "benches", None)  # import benches -> ImportError
    monkeypatch.setitem(sys.modules, "benches.harness", None)
    monkeypatch.setitem(sys.modules, "benches.harness.cli", None)
    monkeypatch.setattr(cli, "_checkout_root", lambda: None)
    with caplog.at_level(logging.ERROR, logger="lmcache_kv_fast.cli"):
        assert cli.cmd_bench(["--help"]) == 2
    assert "source checkout" in caplog.text and "make bench" in caplog.text


@pytest.mark.parametrize("name", ["kvcache", "sdk", "batch", "distributed", "events", "edits",
                                  "testing", "errors"])
def test_public_imports_of_today_work(name):
    """The names users import from the top level are still there (the modules moved under them)."""
    import importlib

    if name == "distributed":
        pytest.importorskip("ray")
    mod = importlib.import_module(f"{PKG}.{name}")
    assert mod.__name__ == f"{PKG}.{name}"
    for attr in ("connect", "KVLayout", "LMCacheKVCacheContext", "KVCacheSDKError", "StoreResult"):
        assert hasattr(lmcache_kv_fast, attr)
    from lmcache_kv_fast.batch import BatchReport, retrieve_many, rewrite, store_many  # noqa: F401
    from lmcache_kv_fast.sdk.hooks import OpenAICompletions  # noqa: F401
