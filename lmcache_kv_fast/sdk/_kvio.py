"""A modify's KV reads and writes, whole streams at a time, through reused row buffers.

For a CPU vLLM engine the server's objects are the engine's raw rows and users edit
per-token K/V (``docs/engine-kv-layout.md``). The core context converts chunk by chunk,
straight out of / into the SHM slots, which is right for large chunks; with a small
model's chunks (the tiny engine: 64 KiB of KV per chunk, 8 chunks a stream) the fixed
cost of every chunk's conversion (views, a native call per plane) is most of a stream's
client time. :class:`StreamKV` therefore reads a stream's rows with one flat gather
into a buffer of the calling thread (``raw=True, out=``), converts them with one call
into the per-token tensor handed to the user's ``fn``, and converts the edit back with
one call into the same buffer (free again once the read was converted), stored as rows
(``raw=True``). The buffer is reused by the thread's next stream (it never leaves this
module: what ``fn`` gets and returns is its own), so one row buffer per worker thread is
alive.

With chunks of :data:`FLAT_MAX_CHUNK_BYTES` (1 MiB) or more the per-chunk cost is small
next to the copy, and the core's own per-chunk conversion straight out of / into the SHM
slots saves the row buffer's extra pass over the data and its memory; those reads and
stores are the context's own calls. Without a CPU engine (the objects are what users
edit) reads and stores are the context's own calls too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

from lmcache_kv_fast.copy import backend
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError
from lmcache_kv_fast.layout import CpuEngineKV
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.sdk.context import LMCacheSDKContext
from lmcache_kv_fast.validation import normalize_tokens

__all__ = ["FLAT_MAX_CHUNK_BYTES", "StreamKV"]

#: Largest chunk (bytes of KV) read and stored through the flat row buffer; from this size
#: the core's per-chunk conversion straight out of / into the SHM slots is used.
FLAT_MAX_CHUNK_BYTES = int(os.environ.get("LMCACHE_KV_FAST_FLAT_MAX_CHUNK", 1 << 20))


def _chunk_bytes(cpu: CpuEngineKV, chunk_size: int) -> int:
    return chunk_size * cpu.num_layers * 2 * cpu.num_kv_heads * cpu.head_dim * \
        cpu.dtype.itemsize


class StreamKV:
    """Whole-stream reads and stores of one SDK context (see the module docstring).

    Args:
        ctx: The SDK context (KV kind).
    """

    def __init__(self, ctx: LMCacheSDKContext) -> None:
        self._ctx = ctx
        kv = ctx.kv_context
        #: The core converts per chunk (CPU engine resolved by the core): read rows here,
        #: unless chunks are large enough for the core's per-chunk conversion to be the
        #: cheaper way (no row buffer pass).
        cpu: CpuEngineKV | None = kv.engine_kv
        if cpu is not None and _chunk_bytes(cpu, kv.chunk_size) >= FLAT_MAX_CHUNK_BYTES:
            cpu = None
        self._cpu = cpu
        self._tls = threading.local()

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """This thread's flat buffer ``name`` with room for ``numel`` elements.

        From the core's result pool (``alloc_result``) when large enough: already faulted
        when a buffer of an earlier modify is idle there, and back to the pool, not to
        glibc's heap, when this context is done with it.
        """
        buf: torch.Tensor | None = getattr(self._tls, name, None)
        if buf is None or buf.numel() < numel:
            buf = None  # the old buffer goes back before the new one is taken
            setattr(self._tls, name, None)
            buf = backend().alloc_result((numel,), self._ctx.dtype)
            setattr(self._tls, name, buf)
        return buf

    def read(self, tokens: Sequence[int], cache_salt: str) -> torch.Tensor | None:
        """The cached prefix of ``tokens`` as per-token K/V (a new tensor), or None.

        Same result as ``ctx.retrieve(tokens, cache_salt)``.
        """
        cpu = self._cpu
        if cpu is None:
            return self._ctx.retrieve(tokens, cache_salt)
        kv = self._ctx.kv_context
        c = kv.chunk_size
        n = len(tokens) // c * c
        if n == 0:
            return None
        shape = kv.kv_shape(n, raw=True)  # [L, n, NH*2*HS]
        buf = self._buffer("rows", shape[0] * shape[1] * shape[2]).narrow(
            0, 0, shape[0] * shape[1] * shape[2]).view(shape)
        rows = kv.retrieve(tokens, cache_salt, raw=True, out=buf)
        if rows is None:
            return None
        hit = rows.shape[1]
        # a recycled native buffer (already faulted) for results from 1 MiB, as the core's
        # own retrieve allocates its result
        out = backend().alloc_result((2, cpu.num_layers, hit, cpu.num_kv_heads * cpu.head_dim),
                                     cpu.dtype)
        return cpu.to_tokens(rows, out=out)

    def store(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str) -> StoreResult:
        """Store per-token ``kv`` under ``tokens`` (whole chunks); ``ctx.store_ex``'s result.

        A CPU engine's edit is converted with one call into this thread's row buffer and
        stored as rows.

        Raises:
            InvalidArgumentError / InvalidTypeError: ``kv`` is not per-token K/V of
                ``len(tokens)`` tokens of the model's dtype.
        """
        cpu = self._cpu
        if cpu is None:
            return self._ctx.store_ex(kv, tokens, cache_salt)
        if not isinstance(kv, torch.Tensor):
            raise InvalidTypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        toks = normalize_tokens(tokens)
        if kv.dim() != 4 or kv.shape[2] != len(toks):
            raise InvalidArgumentError(
                f"kv must be per-token K/V [2, L, T, D] with T = len(tokens) = {len(toks)}, "
                f"got {list(kv.shape)}")
        core = self._ctx.kv_context
        n = len(toks) // core.chunk_size * core.chunk_size
        if n == 0:
            return StoreResult(0, 0, 0, 0, 0)
        shape = core.kv_shape(n, raw=True)
        numel = shape[0] * shape[1] * shape[2]
        rows = cpu.to_raw(kv.narrow(2, 0, n),
                          out=self._buffer("rows", numel).narrow(0, 0, numel).view(shape))
        return core.store_ex(rows, toks[:n], cache_salt, raw=True)
