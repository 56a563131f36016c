"""A modify's memory, made ready while the engine prefills.

A batched stream's modify reads each stream's KV into a result buffer, and the edit's
output goes into another (``copy.backend().alloc_result``, a pool of reused,
already-faulted buffers). Only the first ``max_in_flight + 1`` buffers are new memory,
but their first touch costs a page fault per 4 KiB page, and on a VM the host often
backs a guest page only when the guest first touches it: for large streams those faults
are a large part of the modify. During
:meth:`~lmcache_kv_fast.sdk.batch.LMCacheBatchedStream.prefill` this process only waits
for the engine's answers. So :class:`ModifyPreparation` maps and faults those buffers
then, on one background thread, and the prefill joins it before it returns. The modify
that follows finds them in the pool.

The buffers are the memory the modify would take anyway (they stay pooled afterwards,
as the modify's own would). Sizes come from the streams' prompts (whole chunks) and the
KV context's per-token shape. Nothing is prepared for streams under
:data:`MIN_PREPARE_BYTES` of KV (their faults cost a few milliseconds, and an edit's
smaller output may not be pooled at all, so a prepared buffer could go unused), or
with the torch backend.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from lmcache_kv_fast.copy import backend
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.sdk.request import LMCacheRequestStream, LMCacheRequestStreamError

logger = logging.getLogger(__name__)

__all__ = ["MIN_PREPARE_BYTES", "ModifyPreparation", "modify_buffers"]

#: Smallest stream KV (bytes, as read) whose modify buffers are prepared.
MIN_PREPARE_BYTES = 16 << 20


def modify_buffers(streams: Sequence[LMCacheRequestStream], max_in_flight: int
                   ) -> tuple[int, int]:
    """Size and count of the result buffers a modify of ``streams`` will hold at most.

    The size is the largest stream's KV as read (its tokens' whole chunks, per-token
    shape of its KV context); the count is the streams in flight plus the edit's output.

    Returns:
        ``(nbytes, count)``; ``(0, 0)`` when no stream has a whole chunk or a KV context.
    """
    sizes: list[int] = []
    for s in streams:
        try:
            ctx = s.context(LMCacheSDKCacheKind.KV)
        except LMCacheRequestStreamError:
            continue
        if ctx.closed:
            continue
        kv = ctx.kv_context
        n = (len(s.tokens) + len(s.suffix_tokens)) // kv.chunk_size * kv.chunk_size
        if n == 0:
            continue
        numel = 1
        for d in kv.kv_shape(n):
            numel *= int(d)
        sizes.append(numel * kv.dtype.itemsize)
    if not sizes:
        return 0, 0
    return max(sizes), min(max_in_flight, len(sizes)) + 1


class ModifyPreparation:
    """Maps and faults a modify's result buffers on a background thread.

    Args:
        streams: The streams the modify will edit.
        max_in_flight: The modify's bound of streams in flight.

    Attributes:
        nbytes: Size of each buffer (nothing is prepared under :data:`MIN_PREPARE_BYTES`).
        count: Buffers wanted.
        reserved: Buffers mapped (set when the thread ends; the pool may already have
            held some).
    """

    def __init__(self, streams: Sequence[LMCacheRequestStream], max_in_flight: int) -> None:
        self.nbytes, self.count = modify_buffers(streams, max_in_flight)
        self.reserved = 0
        self._thread: threading.Thread | None = None
        if self.nbytes >= MIN_PREPARE_BYTES and self.count:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="lmcache-kv-fast-prepare-modify")
            self._thread.start()

    def _run(self) -> None:
        try:
            self.reserved = backend().reserve_results(self.nbytes, self.count)
        except Exception as err:  # an optimisation only: the modify maps its own then
            logger.debug("preparing the modify's buffers failed: %s", err)

    def join(self) -> None:
        """Wait for the thread (it maps and faults a bounded amount of memory)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            logger.debug("modify buffers prepared: %d x %d bytes (%d mapped)", self.count,
                         self.nbytes, self.reserved)
