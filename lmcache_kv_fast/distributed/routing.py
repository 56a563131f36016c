"""Routing: which server each sequence goes to.

Three strategies (``route=`` of every fleet call):

* ``"lookup"`` (default): every server looks the sequence up (in parallel, through each
  actor's own context: no extra connections); the server with the longest cached prefix
  wins, ties go to the first server in ``servers`` order; cached nowhere → ``missed``.
* a callable ``route(tokens) -> index | name | Server | None`` (None → ``missed``).
* a :class:`~lmcache_kv_fast.distributed.events_index.KVEventsIndex`: the server whose
  indexed chunk hashes cover the longest prefix; sequences it knows nowhere are confirmed
  by lookups (the index is a hint: SDK stores of other processes are not in it).

For ``store_many`` a sequence cached nowhere is not missed: it is placed on a server
chosen by a hash of its first chunk (deterministic; the next live server when that one is
down).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_kv_fast.distributed.servers import Server
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

#: A routing decision that still needs a lookup fan-out.
NEEDS_LOOKUP = -2


def pick_server(hits: Sequence[int]) -> int | None:
    """Index of the longest cached prefix (first on ties); None when nothing is cached."""
    best, best_hit = None, 0
    for i, h in enumerate(hits):
        if h > best_hit:
            best, best_hit = i, h
    return best


def placement(tokens: Sequence[int], n_servers: int, chunk_size: int, up: Sequence[bool]) -> int | None:
    """Deterministic home of a sequence cached nowhere: crc32 of its first chunk.

    Falls through to the next server that is ``up``; None when none is.
    """
    head = list(tokens[:chunk_size])
    h = zlib.crc32(b"".join(int(t).to_bytes(4, "little", signed=False) for t in head))
    for k in range(n_servers):
        i = (h + k) % n_servers
        if up[i]:
            return i
    return None


def server_index(value: Any, servers: Sequence[Server]) -> int | None:
    """Turn a route function's answer (index, name, :class:`Server`, None) into an index.

    Raises:
        InvalidArgumentError: An index out of range or an unknown name.
        InvalidTypeError: Another type.
    """
    if value is None:
        return None
    if isinstance(value, Server):
        value = value.name
    if isinstance(value, bool):
        raise InvalidTypeError(f"route returned a bool ({value}); expected a server index or name")
    if isinstance(value, int):
        if not 0 <= value < len(servers):
            raise InvalidArgumentError(f"route returned server index {value}; there are {len(servers)}")
        return value
    if isinstance(value, str):
        for i, s in enumerate(servers):
            if value in (s.name, s.url):
                return i
        raise InvalidArgumentError(f"route returned {value!r}, which names no server of the fleet")
    raise InvalidTypeError(
        f"route must return a server index, name, Server or None, got {type(value).__name__}"
    )


class Router:
    """Direct (driver-side) part of a routing strategy.

    Args:
        route: ``"lookup"``, a callable, or a ``KVEventsIndex``.
        servers: The fleet's servers.
    """

    def __init__(self, route: Any, servers: Sequence[Server]) -> None:
        from lmcache_kv_fast.distributed.events_index import KVEventsIndex

        self.servers = list(servers)
        self.index: KVEventsIndex | None = None
        self.fn: Callable[[list[int]], Any] | None = None
        if isinstance(route, str):
            if route != "lookup":
                raise InvalidArgumentError(
                    f"route must be 'lookup', a callable or a KVEventsIndex, got {route!r}")
            self.kind = "lookup"
        elif isinstance(route, KVEventsIndex):
            if [s.url for s in route.servers] != [s.url for s in self.servers]:
                raise InvalidArgumentError("the KVEventsIndex was built for other servers (or another order)")
            self.kind, self.index = "index", route
        elif callable(route):
            self.kind, self.fn = "fn", route
        else:
            raise InvalidTypeError(
                f"route must be 'lookup', a callable or a KVEventsIndex, got {type(route).__name__}"
            )

    def direct(self, tokens: list[int]) -> int | None:
        """The server for ``tokens`` without lookups, :data:`NEEDS_LOOKUP`, or None (missed).

        Raises:
            Exception: Whatever the user's route function raised, or a bad answer of it
                (the item then fails at stage ``route``).
        """
        if self.kind == "lookup":
            return NEEDS_LOOKUP
        if self.kind == "fn":
            assert self.fn is not None
            return server_index(self.fn(tokens), self.servers)
        assert self.index is not None
        best = self.index.best(tokens)
        return NEEDS_LOOKUP if best is None else best
