"""Reusable buffers for batches.

:class:`BufferPool` (retrieve targets of ``retrieve_many``) and :class:`OutputPool` (what
``rewrite`` hands an ``fn`` that takes ``alloc``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import torch

from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError


class BufferPool:
    """A bounded pool of reusable, pre-touched KV buffers of one shape.

    ``retrieve_many(..., out_pool=BufferPool(ctx, max_tokens, n))`` reads each sequence into a
    pooled buffer; the yielded tensor is a view of it, valid until the iterator advances.

    Args:
        ctx: The context (gives shape and dtype).
        max_tokens: Largest sequence the buffers must hold.
        size: Number of buffers (at least the batch's ``max_in_flight``).
    """

    def __init__(self, ctx: LMCacheKVCacheContext, max_tokens: int, size: int) -> None:
        if not isinstance(ctx, LMCacheKVCacheContext):
            raise InvalidTypeError(
                f"BufferPool: ctx must be an LMCacheKVCacheContext, got {type(ctx).__name__}"
            )
        ctx._check_process()
        for name, v in (("max_tokens", max_tokens), ("size", size)):
            if type(v) is not int:
                raise InvalidTypeError(
                    f"BufferPool: {name} must be an int, got {type(v).__name__} {v!r:.40}"
                )
            if v < 1:
                raise InvalidArgumentError(f"BufferPool: {name} must be >= 1, got {v}")
        self.shape = ctx.kv_shape(max_tokens)
        self._free: collections.deque[torch.Tensor] = collections.deque()
        for _ in range(size):
            t = torch.empty(self.shape, dtype=ctx.dtype)
            t.view(-1).view(torch.uint8)[:: 4096].zero_()  # fault the pages in once
            self._free.append(t)
        self._cv = threading.Condition()
        self.size = size

    def acquire(self) -> torch.Tensor:
        """Take a buffer (blocks until one is free)."""
        with self._cv:
            self._cv.wait_for(lambda: bool(self._free))
            return self._free.popleft()

    def release(self, t: torch.Tensor) -> None:
        """Give a buffer back."""
        with self._cv:
            self._free.append(t)
            self._cv.notify()


class OutputPool:
    """Reused, pre-faulted output memory for ``fn`` (``rewrite(..., fn)`` with ``alloc``).

    A fresh large tensor costs a page fault per 4 KiB the first time it is written (often
    more than the edit itself). The pool hands out views of byte buffers it keeps warm;
    every buffer an item took comes back once that item's store has finished. At most
    ``keep`` idle buffers are kept.

    With ``large`` (``rewrite`` passes the native core's ``alloc_result``), outputs of at
    least ``large_min`` bytes come from there instead: the process-wide pool of faulted,
    huge-page buffers, which outlives the batch (the next batch starts warm) and takes a
    buffer back only when the last tensor over it died.

    Args:
        keep: Idle buffers kept for reuse (others are freed).
        large: ``large(shape, dtype)`` for large outputs (None: this pool serves all).
        large_min: Smallest output served by ``large``.
    """

    def __init__(self, keep: int, large: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
                 | None = None, large_min: int = 2 << 20) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._keep = max(1, keep)
        self._large = large
        self._large_min = large_min
        self.allocated = 0  # buffers created (pool misses)

    def alloc(self, shape: Sequence[int], dtype: torch.dtype, taken: list[torch.Tensor]
              ) -> torch.Tensor:
        """A contiguous tensor of ``shape``/``dtype`` (content undefined), recorded in ``taken``."""
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidArgumentError(f"alloc: negative dimension in shape {shape}")
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"alloc: dtype must be a torch.dtype, got {dtype!r}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._large is not None and nbytes >= self._large_min:
            return self._large(shape, dtype)
        buf = None
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._free.remove(buf)
        if buf is None:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            buf[::4096].zero_()  # fault the pages in once; later items reuse them warm
            self.allocated += 1
        taken.append(buf)
        return buf[:nbytes].view(dtype).view(shape)

    def give_back(self, taken: list[torch.Tensor]) -> None:
        """Return an item's buffers (after its store read them)."""
        with self._lock:
            for b in taken:
                self._free.append(b)
            self._free.sort(key=lambda b: -b.numel())
            del self._free[self._keep:]
        taken.clear()
