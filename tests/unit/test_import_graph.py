"""The ``lmcache_kv_fast`` import graph has no cycle; the events package keeps its layering.

The graph is read from the source (``ast``), not from a running interpreter, so every
``import`` counts: module level, inside functions (deferred), and under ``TYPE_CHECKING``.
An edge goes from a module to each ``lmcache_kv_fast`` module it names; ``from pkg import
name`` points at ``pkg.name`` when that is a module, else at ``pkg``. The implicit import of
a parent package (Python runs ``a/__init__`` before ``a.b``) is not an edge: with it every
package whose ``__init__`` imports its own submodules would count as a cycle.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = "lmcache_kv_fast"
EVENTS = f"{PACKAGE}.events"


# ------------------------------------------------------------------ graph
def _modules(root: Path, package: str) -> dict[str, Path]:
    """Map dotted module names to files for every ``.py`` below ``root`` (the package dir)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package, or None."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Return ``{module: {imported package modules}}`` for the package at ``root``."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = mod.split(".")
                    drop = node.level - 1 if is_pkg else node.level
                    anchor = anchor[:len(anchor) - drop] if drop else anchor
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for t in targets:
                dst = _owner(t, modules) if t.split(".")[0] == package else None
                if dst is not None and dst != mod:
                    graph[mod].add(dst)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _package_root() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(_package_root(), PACKAGE)


# ------------------------------------------------------------------ the detector itself
def test_detector_finds_a_deferred_cycle_and_resolves_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("from pkg import b\n\ndef f():\n    return b\n")
    (pkg / "b.py").write_text(textwrap.dedent("""
        import os

        def g():
            from pkg.a import f  # deferred: still an edge
            return f
    """))
    (pkg / "sub" / "__init__.py").write_text("from . import c\nfrom .. import b\n")
    (pkg / "sub" / "c.py").write_text("from .d import x\nfrom ..a import f\n")
    (pkg / "sub" / "d.py").write_text("x = 1\n")
    g = import_graph(pkg, "pkg")
    assert g == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a"},
        "pkg.sub": {"pkg.sub.c", "pkg.b"},
        "pkg.sub.c": {"pkg.sub.d", "pkg.a"},
        "pkg.sub.d": set(),
    }
    assert find_cycles(g) == [["pkg.a", "pkg.b"]]
    g["pkg.b"] = {"pkg.sub.d"}
    assert find_cycles(g) == []


# ------------------------------------------------------------------ the package
def test_graph_covers_the_whole_package(graph):
    root = _package_root()
    assert len(graph) == len([p for p in root.rglob("*.py") if "__pycache__" not in p.parts])
    for mod in (PACKAGE, f"{PACKAGE}.cli", f"{PACKAGE}.errors", EVENTS, f"{EVENTS}.command",
                f"{PACKAGE}.protocol.codec"):
        assert mod in graph
    # deferred (function-level) imports are edges: cli.cmd_events imports the command
    assert f"{EVENTS}.command" in graph[f"{PACKAGE}.cli"]
    assert f"{PACKAGE}.errors" in graph[PACKAGE]


def test_package_has_no_import_cycle(graph):
    cycles = find_cycles(graph)
    assert cycles == [], "import cycles in lmcache_kv_fast:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


# ------------------------------------------------------------------ events layering
#: What each module of the events package may import of the package (arrows point down:
#: command -> publisher -> {stream, announce, vllm_format}; stream -> stream_io -> endpoint).
EVENTS_ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "endpoint": {"common"},
    "stream_io": {"common"},
    "surface": {"stream_io"},
    "keepalive": {"endpoint"},
    "stream_grpc": {"common", "endpoint", "keepalive", "stream_io", "surface"},
    "stream": {"common", "endpoint", "keepalive", "stream_io", "stream_grpc", "surface"},
    "announce": {"common"},
    "vllm_format": {"common"},
    "publisher": {"common", "endpoint", "stream_io", "stream", "announce", "vllm_format"},
    "command": {"publisher", "vllm_format"},
}


def test_events_package_layering(graph):
    subs = {m.removeprefix(EVENTS + "."): m for m in graph if m.startswith(EVENTS + ".")}
    assert set(subs) == set(EVENTS_ALLOWED)
    for short, mod in subs.items():
        inside = {d.removeprefix(EVENTS + ".") for d in graph[mod]
                  if d == EVENTS or d.startswith(EVENTS + ".")}
        assert inside <= EVENTS_ALLOWED[short], f"{mod} imports {sorted(inside)}"
        assert EVENTS not in graph[mod], f"{mod} imports the events package facade"
    importers = sorted(m for m, deps in graph.items() if f"{EVENTS}.command" in deps)
    # the command (lmcache-kv-fast events) and the facade's deferred events_main
    assert importers == [f"{PACKAGE}.cli", EVENTS]


def test_importing_events_does_not_load_the_command_module():
    code = textwrap.dedent(f"""
        import sys
        import {EVENTS} as ev
        assert "{EVENTS}.command" not in sys.modules, "events imported its cli"
        import {EVENTS}.command as cli
        assert ev.events_main is not cli.events_main and callable(ev.events_main)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_events_facade_is_the_module_the_context_announces_through():
    """context.py calls has_listeners / announce_store on sys.modules[EVENTS]."""
    import lmcache_kv_fast.events as ev
    from lmcache_kv_fast.events import announce

    mod = sys.modules[EVENTS]
    assert mod is ev
    assert mod.has_listeners is announce.has_listeners
    assert mod.announce_store is announce.announce_store
    model = "import-graph/test-model"
    got: list[object] = []
    remove = ev.add_listener(model, got.append)
    try:
        assert mod.has_listeners(model)
        assert not mod.has_listeners(model + "-other")
    finally:
        remove()
    assert not mod.has_listeners(model)
    assert got == []
