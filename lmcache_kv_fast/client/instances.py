"""The instance ids this process's SDK contexts register on servers, in one place.

Every SDK context registers engine-driven (``register_kv_cache_engine_driven_context``)
under a random 63-bit instance id, and the server lists those registrations in
``/status`` ``non_cuda_context_meta`` next to a CPU vLLM engine's, with the same four
fields and an equally random id. When ``connect()`` derives a CPU engine's geometry from
that table (``client/engine_kv.py``), it must not take one of this process's own
contexts for the engine: it excludes :func:`own_instance_ids`.

Every id a context registers under (the context's own and any further registration of it,
e.g. a separate writer registration) comes from :func:`new_instance_id` and goes back with
:func:`release_instance_id` when the context is torn down.
"""

from __future__ import annotations

import secrets
import threading

from lmcache_kv_fast.protocol.constants import INSTANCE_ID_BITS

__all__ = ["new_instance_id", "own_instance_ids", "release_instance_id"]

_lock = threading.Lock()
_ids: set[int] = set()


def new_instance_id() -> int:
    """A fresh random instance id in ``[1, 2**63)``, recorded as this process's own."""
    with _lock:
        while True:
            iid = secrets.randbits(INSTANCE_ID_BITS) or 1
            if iid not in _ids:
                _ids.add(iid)
                return iid


def release_instance_id(iid: int) -> None:
    """Forget ``iid`` (its context is gone). Unknown ids are ignored."""
    with _lock:
        _ids.discard(iid)


def own_instance_ids() -> frozenset[int]:
    """The instance ids this process's live SDK contexts registered (or may register)."""
    with _lock:
        return frozenset(_ids)
