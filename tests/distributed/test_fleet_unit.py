"""Pieces of lmcache_kv_fast.distributed that need no cluster: servers, routing, report,
and the import contract (no Ray -> a clear error naming the extra; the SDK never imports Ray)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray", reason="lmcache_kv_fast.distributed needs Ray")

from lmcache_kv_fast.distributed import FleetItemError, FleetReport, Server
from lmcache_kv_fast.distributed.routing import (
    NEEDS_LOOKUP,
    Router,
    pick_server,
    placement,
    server_index,
)
from lmcache_kv_fast.distributed.servers import as_servers, resolve_node
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

pytestmark = pytest.mark.distributed

A = Server("tcp://127.0.0.1:5555", "http://127.0.0.1:8080", name="a")
B = Server("tcp://10.1.2.3:5555", "http://10.1.2.3:8080")


def run_py(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_importing_the_sdk_never_imports_ray():
    r = run_py("""
        import sys
        import lmcache_kv_fast, lmcache_kv_fast.batch, lmcache_kv_fast.events, lmcache_kv_fast.cli
        import lmcache_kv_fast.kvcache, lmcache_kv_fast.testing
        assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray"))
        print("clean")
    """)
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr


def test_without_ray_the_error_names_the_extra():
    r = run_py("""
        import sys
        sys.modules["ray"] = None  # what an environment without Ray looks like to `import ray`
        from lmcache_kv_fast.errors import KVCacheSDKError, MissingExtraError
        try:
            import lmcache_kv_fast.distributed
        except ImportError as err:
            assert isinstance(err, MissingExtraError) and isinstance(err, KVCacheSDKError)
            print(err)
        else:
            raise SystemExit("imported without Ray")
    """)
    assert r.returncode == 0, r.stderr
    assert "pip install 'lmcache-kv-fast[ray]'" in r.stdout


def test_servers_are_validated_and_named():
    assert B.name == B.url and B.host == "10.1.2.3"
    got = as_servers([A, ("tcp://h:1", "http://h:2"), {"url": "tcp://h:3", "http_url": "http://h:4",
                                                        "node": "n1"}])
    assert [s.name for s in got] == ["a", "tcp://h:1", "tcp://h:3"] and got[2].node == "n1"
    with pytest.raises(InvalidArgumentError, match="tcp://host:port"):
        Server("http://h:1", "http://h:2")
    with pytest.raises(InvalidArgumentError, match="http://host:port"):
        Server("tcp://h:1", "h:2")
    with pytest.raises(InvalidArgumentError, match="same name"):
        as_servers([A, Server("tcp://h:9", "http://h:9", name="a")])
    with pytest.raises(InvalidArgumentError, match="empty"):
        as_servers([])
    with pytest.raises(InvalidTypeError):
        as_servers("tcp://h:1")
    with pytest.raises(InvalidTypeError):
        as_servers([42])


def test_node_resolution():
    nodes = [{"NodeID": "n0", "NodeManagerAddress": "10.1.2.3", "Alive": True},
             {"NodeID": "n1", "NodeManagerAddress": "10.9.9.9", "Alive": True},
             {"NodeID": "n2", "NodeManagerAddress": "10.9.9.9", "Alive": True},
             {"NodeID": "dead", "NodeManagerAddress": "10.7.7.7", "Alive": False}]
    assert resolve_node(B, nodes, "n1") == "n0"  # the node whose IP the URL names
    assert resolve_node(A, nodes, "n1") == "n1"  # loopback: the driver's node
    assert resolve_node(Server("tcp://10.5.5.5:1", "http://10.5.5.5:2"), nodes, "n1") is None
    assert resolve_node(Server("tcp://x:1", "http://x:2", node="n2"), nodes, None) == "n2"
    shared = Server("tcp://10.9.9.9:1", "http://10.9.9.9:2")
    assert resolve_node(shared, nodes, "n2") == "n2"
    with pytest.raises(InvalidArgumentError, match="node id"):
        resolve_node(shared, nodes, "n0")
    with pytest.raises(InvalidArgumentError, match="live Ray node"):
        resolve_node(Server("tcp://x:1", "http://x:2", node="dead"), nodes, None)


def test_route_choices():
    assert pick_server([0, 512, 512, 256]) == 1  # longest, first on ties
    assert pick_server([0, -1, 0]) is None
    up = [True, True, True]
    homes = {placement(list(range(k, k + 300)), 3, 256, up) for k in range(40)}
    assert homes == {0, 1, 2}
    h = placement(list(range(300)), 3, 256, up)
    assert placement(list(range(300)), 3, 256, up) == h
    down = [i != h for i in range(3)]
    assert placement(list(range(300)), 3, 256, down) == (h + 1) % 3
    assert placement(list(range(300)), 3, 256, [False] * 3) is None
    servers = [A, B]
    assert [server_index(v, servers) for v in (0, 1, "a", B.url, B, None)] == [0, 1, 0, 1, 1, None]
    for bad, exc in ((2, InvalidArgumentError), ("zz", InvalidArgumentError),
                     (True, InvalidTypeError), (1.0, InvalidTypeError)):
        with pytest.raises(exc):
            server_index(bad, servers)
    assert Router("lookup", servers).direct([1, 2]) == NEEDS_LOOKUP
    assert Router(lambda t: "a", servers).direct([1]) == 0
    with pytest.raises(InvalidArgumentError):
        Router("nearest", servers)
    with pytest.raises(InvalidTypeError):
        Router(3, servers)


def test_report_merges_per_server():
    rep = FleetReport()
    rep.add_outcome("a", 0, "ok", "", "", 512, 1000, {"retrieve": 0.5}, 1)
    rep.add_outcome("a", 1, "failed", "store", "boom", 0, 0, {}, 2)
    rep.add_outcome(None, 2, "missed", "route", "cached on no server", 0, 0, {}, 0)
    rep.add_outcome("b", 3, "ok", "", "", 256, 500, {"retrieve": 0.25}, 1)
    assert (rep.items, rep.ok, rep.failed, rep.missed) == (4, 2, 1, 1)
    assert (rep.tokens_moved, rep.bytes_moved) == (768, 1500)
    assert rep.stage_seconds["retrieve"] == 0.75
    assert rep.errors == [FleetItemError(1, "store", "boom", "a", 2),
                          FleetItemError(2, "route", "cached on no server", None, 0)]
    a = rep.per_server["a"]
    assert (a.items, a.ok, a.failed, a.bytes_moved) == (2, 1, 1, 1000)
    assert [e.index for e in a.errors] == [1]
    assert rep.routes == {0: "a", 1: "a", 2: None, 3: "b"}
    text = rep.summary()
    assert "4 items: 2 ok, 1 missed, 1 failed" in text and "\n  a: 1/2 ok" in text
