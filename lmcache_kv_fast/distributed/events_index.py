"""A driver-side index of which server holds which chunks, fed by KV events.

Each server's ``subscribe_kv_events`` stream (:func:`lmcache_kv_fast.events.subscribe`) is
followed on a thread: ``stored`` records add their chunk hash to that server's set,
``removed`` records (eviction, ``clear``) drop theirs, and a resync (lost records, server
restarted) empties the set. What the server's stream covers (docs/protocol.md §9, §11 #21):

* **engine stores** (vLLM's lmcache-driven path): announced as ``stored`` records;
* **every removal**, whoever stored the chunk;
* **SDK stores: not announced by the server.** The fleet feeds the index itself with the
  hashes of what its actors stored (``rewrite`` / ``store_many`` through this package);
  other SDK processes can forward theirs with :meth:`KVEventsIndex.note_tokens` (e.g. from
  an :func:`lmcache_kv_fast.events.add_listener` callback).

Hashes carry no salt and no world size (docs/protocol.md §8.2): the index is a *hint*. Routing
with it (``route=index``) confirms sequences it knows nowhere with lookups, and an item it
sent to a server that no longer holds the prefix is routed again by lookups.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

from lmcache_kv_fast.distributed.servers import Server, as_servers
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError

logger = logging.getLogger(__name__)


class KVEventsIndex:
    """Chunk hashes per server, kept current from the servers' KV-event streams.

    Args:
        servers: The fleet's servers (same order as the fleet's).
        model_name: Model whose events are followed.
        timeout: Probe/subscribe timeout per server.

    Raises:
        KVCacheSDKError: A server has no KV-event stream, or the servers disagree on the
            chunk size or do not hash with blake3.
    """

    def __init__(self, servers: Any, model_name: str, *, timeout: float = 10.0) -> None:
        from lmcache_kv_fast import events
        from lmcache_kv_fast.hashing import HASH_ALGORITHM, require_blake3

        require_blake3()
        self.servers: list[Server] = as_servers(servers)
        self.model_name = model_name
        self._lock = threading.Lock()
        self._sets: list[set[bytes]] = [set() for _ in self.servers]
        self.resyncs = [0] * len(self.servers)
        self.events_seen = [0] * len(self.servers)
        self._subs: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        chunk_sizes = set()
        try:
            for i, s in enumerate(self.servers):
                ep = events.EventsEndpoint.probe(s.url, s.http_url, model_name, timeout=timeout)
                if ep.hash_algorithm != HASH_ALGORITHM:
                    raise KVCacheSDKError(
                        f"server {s.name!r} hashes chunks with {ep.hash_algorithm!r}; the index "
                        f"reproduces only {HASH_ALGORITHM!r}"
                    )
                chunk_sizes.add(ep.chunk_size)
                sub = events.subscribe(ep, timeout=None)
                self._subs.append(sub)
                th = threading.Thread(target=self._follow, args=(i, sub), daemon=True,
                                      name=f"lmckv-events-index-{i}")
                self._threads.append(th)
            if len(chunk_sizes) != 1:
                raise KVCacheSDKError(f"the servers use different chunk sizes {sorted(chunk_sizes)}")
        except BaseException:
            self.close()
            raise
        self.chunk_size = chunk_sizes.pop()
        for th in self._threads:
            th.start()

    # ------------------------------------------------------------------ feeding
    def _follow(self, i: int, sub: Any) -> None:
        try:
            for batch in sub:
                self._apply(i, batch)
                if self._stop.is_set():
                    return
        except KVCacheSDKError as err:
            if not self._stop.is_set():
                logger.warning("KV events of %s stopped: %s (its index entries are dropped)",
                               self.servers[i].name, err)
                with self._lock:
                    self._sets[i].clear()

    def _apply(self, i: int, batch: Any) -> None:
        with self._lock:
            if batch.resync:
                self.resyncs[i] += 1
                self._sets[i].clear()
            for rec in batch.events:
                self.events_seen[i] += 1
                if rec.kind == "stored":
                    self._sets[i].update(rec.block_hashes)
                elif rec.kind == "removed":
                    self._sets[i].difference_update(rec.block_hashes)

    def note_hashes(self, server: int, hashes: Sequence[bytes]) -> None:
        """Record chunk hashes stored on ``servers[server]`` (the fleet calls this)."""
        if not 0 <= server < len(self.servers):
            raise InvalidArgumentError(f"server index {server} out of range")
        with self._lock:
            self._sets[server].update(hashes)

    def note_tokens(self, server: int, tokens: Sequence[int], chunks: int | None = None) -> None:
        """Record an SDK store of ``tokens`` (its leading ``chunks``) on ``servers[server]``."""
        from lmcache_kv_fast.hashing import chunk_hashes

        self.note_hashes(server, chunk_hashes(list(tokens), self.chunk_size, max_chunks=chunks))

    # ------------------------------------------------------------------ queries
    def prefix_chunks(self, tokens: Sequence[int]) -> list[int]:
        """Leading chunks of ``tokens`` each server holds, per the index."""
        from lmcache_kv_fast.hashing import chunk_hashes

        hashes = chunk_hashes(list(tokens), self.chunk_size)
        out = []
        with self._lock:
            for s in self._sets:
                n = 0
                for h in hashes:
                    if h not in s:
                        break
                    n += 1
                out.append(n)
        return out

    def best(self, tokens: Sequence[int]) -> int | None:
        """Server with the longest indexed prefix (first on ties), None if none has one."""
        best, best_n = None, 0
        for i, n in enumerate(self.prefix_chunks(tokens)):
            if n > best_n:
                best, best_n = i, n
        return best

    def size(self) -> list[int]:
        """Indexed chunks per server."""
        with self._lock:
            return [len(s) for s in self._sets]

    def close(self) -> None:
        """Stop following the streams (idempotent)."""
        self._stop.set()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                sub.close()
        for th in self._threads:
            if th.is_alive():
                th.join(timeout=5.0)

    def __enter__(self) -> KVEventsIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
