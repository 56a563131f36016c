"""What a call reports: :class:`StoreResult` (chunk by chunk) and :class:`OpTiming` (phases)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoreResult:
    """What a store did, chunk by chunk (``ctx.store_ex``).

    Attributes:
        tokens_stored: Whole-chunk tokens of the sequence that are in the cache after the
            call (its cached prefix, capped at ``chunks_total * chunk_size``).
        chunks_total: Whole chunks in the request (a trailing partial chunk is dropped).
        chunks_written: Chunks written by this call.
        chunks_already_cached: Chunks that were already in the cache (not rewritten).
        chunks_refused: Chunks the server could not take (L1 full) or that are not
            visible after the call.
    """

    tokens_stored: int
    chunks_total: int
    chunks_written: int
    chunks_already_cached: int
    chunks_refused: int

    @property
    def ok(self) -> bool:
        """True when every whole chunk is in the cache after the call."""
        return self.chunks_total > 0 and self.chunks_refused == 0


@dataclass(frozen=True)
class OpTiming:
    """Where the time of one ``store`` / ``retrieve`` / ``lookup`` call went.

    Read it with :attr:`~lmcache_kv_fast.client.context.LMCacheKVCacheContext.last_timing` right
    after the call (per thread). Costs a few ``perf_counter`` reads per call.

    Attributes:
        op: ``"store"``, ``"retrieve"`` or ``"lookup"``.
        total_s: Wall time of the call.
        wait_s: Time blocked on server replies: network round trips plus the server's
            processing of each request (its per-chunk bookkeeping dominates on a local
            server).
        copy_s: Time in the data plane's copies (scatter into / gather out of the SHM pool,
            or into / out of pickle-plane frames).
        alloc_s: Time allocating the result of a retrieve without ``out`` (fresh memory is
            mapped and faulted in here; a reused pooled buffer costs microseconds).
        rpcs: Replies waited for (releases sent without waiting, a retrieve's
            ``commit_retrieve`` and ``end_session``, not counted).
        chunks: Whole chunks the call moved (0 for a lookup or a miss).
        hinted: Chunks of a retrieve read (on every shard) from where they lay last time
            before the server's ``prepare_retrieve`` reply came, and kept because the reply
            named the same slots (see ``read_hints`` of :func:`~lmcache_kv_fast.connect`).
        rehinted: Chunks read that way and read again (on some shard) because the reply
            named other slots (both copies count in ``copy_s``).
    """

    op: str
    total_s: float
    wait_s: float
    copy_s: float
    alloc_s: float
    rpcs: int
    chunks: int
    hinted: int = 0
    rehinted: int = 0

    @property
    def client_s(self) -> float:
        """The rest: argument checks, encoding, decoding, layout of frames, Python."""
        return max(0.0, self.total_s - self.wait_s - self.copy_s - self.alloc_s)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (for JSON), with ``client_s``."""
        return {"op": self.op, "total_s": self.total_s, "wait_s": self.wait_s,
                "copy_s": self.copy_s, "alloc_s": self.alloc_s, "client_s": self.client_s,
                "rpcs": self.rpcs, "chunks": self.chunks, "hinted": self.hinted,
                "rehinted": self.rehinted}
