"""Functions run after each store of this SDK, registered by higher layers.

The server records no ``stored`` KV event for an SDK store (docs/protocol.md §11 #21), so
:mod:`lmcache_kv_fast.events` announces them itself: on import it registers a hook here,
and the context runs the hooks after every store that wrote something. Without hooks a
store pays one empty-tuple check.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

#: ``hook(ctx, tokens, cache_salt, chunks_stored)``: the store's context, the whole-chunk
#: tokens it stored, its salt, and how many chunks of them it wrote.
StoreHook = Callable[[Any, Sequence[int], str, int], None]

_lock = threading.Lock()
_hooks: tuple[StoreHook, ...] = ()


def add_store_hook(fn: StoreHook) -> None:
    """Run ``fn`` after every store of this process's contexts (once per function)."""
    global _hooks
    with _lock:
        if fn not in _hooks:
            _hooks = (*_hooks, fn)


def remove_store_hook(fn: StoreHook) -> None:
    """Stop running ``fn`` (no error when it was not added)."""
    global _hooks
    with _lock:
        _hooks = tuple(h for h in _hooks if h is not fn)


def run_store_hooks(ctx: Any, tokens: Sequence[int], cache_salt: str, chunks: int) -> None:
    """Run every hook; a hook that raises is logged, never the store's failure."""
    for fn in _hooks:
        try:
            fn(ctx, tokens, cache_salt, chunks)
        except Exception:
            logger.exception("store hook %r failed", fn)
