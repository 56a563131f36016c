"""Many sequences at once: pipelined ``retrieve_many`` / ``store_many`` / ``rewrite``.

Each item runs the ordinary context flows on a few threads, so the round trips and copies
of some sequences overlap those of others, with at most ``max_in_flight`` items alive
(memory bounded by ``max_in_flight`` × the largest KV). ``rewrite`` runs on
:class:`RewriteEngine`: retrieves and stores on I/O threads, the edit on its own thread
with large outputs from the warm result pool. One item's error is recorded in the
:class:`BatchReport` and the batch goes on; ``KeyboardInterrupt`` or a closed context
stops it once the in-flight server calls ended, leaving nothing on the server.
User guide: docs/batch.md.

Modules (private): ``_api`` (the functions), ``_engine`` (the rewrite engine), ``_workers``
(its threads and item record), ``_liveness`` (the server watch), ``_report`` (reports and
item results), ``_pools`` (buffers and outputs), ``_policy`` (how the edit runs), with
``_shapes`` (output shapes) and ``_gather`` (token-dropping gathers on the core).
"""

from lmcache_kv_fast.batch._api import (
    DEFAULT_MAX_IN_FLIGHT,
    REWRITE_MAX_IN_FLIGHT,
    ModifyFn,
    release_buffers,
    retrieve_many,
    rewrite,
    store_many,
)
from lmcache_kv_fast.batch._engine import RewriteEngine, run_rewrite
from lmcache_kv_fast.batch._fused import FusedHooks
from lmcache_kv_fast.batch._pools import BufferPool, OutputPool
from lmcache_kv_fast.batch._report import BatchReport, ItemError, ItemResult

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "REWRITE_MAX_IN_FLIGHT",
    "BatchReport",
    "BufferPool",
    "FusedHooks",
    "ItemError",
    "ItemResult",
    "ModifyFn",
    "OutputPool",
    "RewriteEngine",
    "release_buffers",
    "retrieve_many",
    "rewrite",
    "run_rewrite",
    "store_many",
]
