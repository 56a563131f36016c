"""Shared helpers of the reliability suite (no fixtures here: see each test module).

* :func:`install_frame_watch` wraps ``zmq.Socket.send`` of this process so every message
  a DEALER socket sends is counted by frames; :func:`one_frame_messages` lists the
  one-frame messages ever sent (a single one kills a real server's loop, docs/protocol.md §2.7).
* :func:`leftovers` reads the server state an SDK must leave clean.
* :func:`open_plane` is the body of a module's ``plane`` fixture (a model and a context on
  the server of one data plane).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from conftest import Model, make_model, wait_all_zero

import lmcache_kv_fast as lkf
from lmcache_kv_fast.testing import LMCacheServer

#: What a ``plane`` fixture yields: the server, a registered model, a context on it.
Plane = tuple[LMCacheServer, Model, lkf.LMCacheKVCacheContext]

_watch_lock = threading.Lock()
_pending: dict[int, int] = {}
_one_frame: list[str] = []
_messages = [0]
_installed = [False]


def install_frame_watch() -> None:
    """Count the frames of every DEALER message this process sends (idempotent)."""
    if _installed[0]:
        return
    _installed[0] = True
    orig = zmq.Socket.send

    def send(self: zmq.Socket, data: Any, flags: int = 0, *args: Any, **kw: Any) -> Any:
        if self.type == zmq.DEALER:
            with _watch_lock:
                n = _pending.pop(id(self), 0) + 1
                if flags & zmq.SNDMORE:
                    _pending[id(self)] = n
                else:
                    _messages[0] += 1
                    if n < 2:
                        _one_frame.append(repr(bytes(data)[:40]))
        return orig(self, data, flags, *args, **kw)

    zmq.Socket.send = send  # type: ignore[method-assign]


def one_frame_messages() -> list[str]:
    """One-frame DEALER messages sent so far (should stay empty)."""
    with _watch_lock:
        return list(_one_frame)


def dealer_messages() -> int:
    """DEALER messages sent so far (to show the watch saw traffic)."""
    with _watch_lock:
        return _messages[0]


def leftovers(server: LMCacheServer) -> dict[str, int]:
    """Sessions, prefetch jobs, locks and staged objects the server still holds."""
    st = server.settled_status()
    l1 = st["storage_manager"]["l1_manager"]
    return {
        "active_sessions": int(st["active_sessions"]),
        "active_prefetch_jobs": int(st["active_prefetch_jobs"]),
        "read_locked_count": int(l1["read_locked_count"]),
        "write_locked_count": int(l1["write_locked_count"]),
        "staging_object_count": int(l1.get("staging_object_count", 0)),
    }


def wait_clean(server: LMCacheServer, timeout: float = 5.0) -> dict[str, int]:
    """Poll :func:`leftovers` until everything is zero or ``timeout``; return the last."""
    return wait_all_zero(lambda: leftovers(server), timeout, 0.1)


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.5) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def open_plane(request: pytest.FixtureRequest, *, num_layers: int, num_kv_heads: int,
               head_size: int) -> Iterator[Plane]:
    """A model and a context on ``server_<request.param>`` (``shm`` or ``pickle``).

    The body of a module-scoped ``plane`` fixture (``yield from open_plane(...)``); after
    the context is closed, no one-frame message was ever sent.
    """
    srv: LMCacheServer = request.getfixturevalue(f"server_{request.param}")
    m = make_model(srv, num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size)
    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=10)
    try:
        yield srv, m, ctx
    finally:
        ctx.close()
    assert one_frame_messages() == []
