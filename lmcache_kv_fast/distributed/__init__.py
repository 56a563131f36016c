"""Batch KV rewriting across a fleet of LMCache servers, on Ray (extra ``ray``).

One actor per server, pinned to the server's Ray node, runs the pipelined batch engine
against its local server over shared memory; the driver routes each sequence to the
server that holds its prefix, bounds the items in flight per actor, merges the reports
and retries the items of a lost actor::

    import logging

    from lmcache_kv_fast.distributed import Server, rewrite

    servers = [Server("tcp://10.0.0.1:5555", "http://10.0.0.1:8080"),
               Server("tcp://10.0.0.2:5555", "http://10.0.0.2:8080")]
    report = rewrite(servers, "my-model", token_lists, drop_tokens)
    logging.getLogger(__name__).info("%s", report.summary())  # a text table

Modules: :mod:`.servers` (addresses, node resolution), :mod:`.fleet` (:class:`Fleet`,
actor lifecycle, the one-call functions), :mod:`._scheduler` (the driver loop),
:mod:`.actor` (the per-server actor), :mod:`._engine` (the per-actor item engine; the only
user of ``batch`` internals), :mod:`.routing`, :mod:`.events_index`, :mod:`.report`,
:mod:`.data` (the Ray Data form). See docs/distributed.md.

Importing this package without Ray raises :class:`~lmcache_kv_fast.errors.MissingExtraError`
(an ``ImportError``) naming ``pip install 'lmcache-kv-fast[ray]'``.
"""

from __future__ import annotations

from lmcache_kv_fast.distributed._raycompat import require_ray

require_ray()

from lmcache_kv_fast.distributed.data import KVRewriteBatches, rewrite_dataset  # noqa: E402
from lmcache_kv_fast.distributed.events_index import KVEventsIndex  # noqa: E402
from lmcache_kv_fast.distributed.fleet import Fleet, retrieve_many, rewrite, store_many  # noqa: E402
from lmcache_kv_fast.distributed.report import FleetItemError, FleetReport  # noqa: E402
from lmcache_kv_fast.distributed.servers import Server  # noqa: E402

__all__ = [
    "Fleet",
    "FleetItemError",
    "FleetReport",
    "KVEventsIndex",
    "KVRewriteBatches",
    "Server",
    "retrieve_many",
    "rewrite",
    "rewrite_dataset",
    "store_many",
]
