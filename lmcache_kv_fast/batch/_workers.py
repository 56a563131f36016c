"""Pieces of the rewrite engine: its worker threads, its per-item record, small checks."""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_kv_fast.batch._report import ItemResult

logger = logging.getLogger("lmcache_kv_fast.batch")

#: ``store_step(res, new_kv, new_tokens, cache_salt)`` -> ``res.value``: stores an edit
#: and accounts it into ``res`` (stages, tokens, bytes, status); raising fails the item.
StoreStepFn = Callable[[ItemResult, torch.Tensor, Sequence[int], str], Any]


def accepts_alloc(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes an ``alloc`` keyword argument."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("alloc")
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)


def shares_memory(t: Any, buf: torch.Tensor) -> bool:
    """Whether ``t`` (what ``fn`` returned) may lie in ``buf``'s memory (True if unsure)."""
    if not isinstance(t, torch.Tensor):
        return True
    try:
        a, b = t.untyped_storage(), buf.untyped_storage()
        a0, b0 = a.data_ptr(), b.data_ptr()
        return a0 < b0 + b.nbytes() and b0 < a0 + a.nbytes()
    except (RuntimeError, NotImplementedError):
        return True


class Workers:
    """``n`` threads serving a priority queue (lower first, FIFO within a priority)."""

    def __init__(self, n: int, name: str, init: Callable[[], None] | None = None) -> None:
        self._q: queue.PriorityQueue[tuple[int, int, Any, tuple[Any, ...]]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._init = init
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, prio: int, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)`` at priority ``prio``."""
        self._q.put((prio, next(self._seq), fn, args))

    def _loop(self) -> None:
        if self._init is not None:
            try:
                self._init()
            except Exception as err:  # a policy that cannot apply must not stop the batch
                logger.warning("edit thread setup failed: %r", err)
        while True:
            _, _, fn, args = self._q.get()
            if fn is None:
                return
            fn(*args)  # stage functions handle every exception themselves

    def close(self) -> None:
        """Run what is queued, then stop and join the threads."""
        for _ in self._threads:
            self._q.put((1 << 30, next(self._seq), None, ()))
        for t in self._threads:
            t.join()


@dataclass
class Item:
    """One item between its stages (its buffers, its edit, its per-item overrides)."""

    index: int
    item: Any
    res: ItemResult
    done: cf.Future[ItemResult] = field(default_factory=cf.Future)
    buf: torch.Tensor | None = None
    kv: torch.Tensor | None = None
    toks: Sequence[int] = ()
    new_kv: torch.Tensor | None = None
    new_toks: Sequence[int] = ()
    taken: list[torch.Tensor] = field(default_factory=list)
    fn: Callable[..., Any] | None = None  # per-item overrides (service mode)
    salt: str | None = None
    store_step: StoreStepFn | None = None
