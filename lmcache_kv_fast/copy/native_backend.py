"""Native copy backend: the C++ core (:mod:`lmcache_kv_fast._native`).

Same function list and validation semantics as :mod:`copy.torch_backend`; the copies run
in a persistent C++ thread pool with the GIL released, split evenly by bytes across the
threads. Importing this module imports the extension, so :mod:`copy.select` falls back to
the torch backend when the compiled module is missing.

Safety model: Python hands the core raw addresses, and every address range is validated
before the GIL is released. The KV tensor passes :mod:`copy.tensor_checks` (its storage
holds what its shape addresses; neg/conj bits resolved for a source, refused for a
destination) and the core gets its data pointer with the bytes its storage really holds
from there, so the core's own bounds check is against the real memory too (a failure
there, ``_native.TensorSpanError``, becomes :class:`InvalidArgumentError`). Regions must
come from :meth:`NativeSegment.regions` (checked against the mapping, which stays mapped
until copies using it finish even if closed meanwhile) or carry a CPU tensor whose storage
covers them (:meth:`Region.of_tensor`, the torch backend's regions); regions with only a
raw address are refused.

Tuning (environment): ``LMCACHE_KV_FAST_THREADS`` (copy threads, default: usable CPUs),
``LMCACHE_KV_FAST_RESULT_POOL_MB`` (bytes of recycled result buffers kept, default
min(4 GiB, RAM/8)), ``LMCACHE_KV_FAST_STREAM_INTERLEAVE`` (4 KiB pages a streaming copy
walks in lock step, 1..64; default 1 on AMD CPUs, 8 on others: ``csrc/copy_kernels.cpp``).
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmcache_kv_fast import _native
from lmcache_kv_fast.copy.base import (
    MAX_COPY_THREADS,
    ChunkGeometry,
    Region,
    SlotLike,
    check_chunk_ids,
    check_copy_threads,
    check_tensor_view,
    numel,
)
from lmcache_kv_fast.copy.fused_checks import (
    ROTATION_DTYPES,
    check_block_engine,
    check_index,
    check_rotation,
    rotation_dtype,
)
from lmcache_kv_fast.copy.tensor_checks import check_destination, check_source
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from lmcache_kv_fast.copy.edit_kernels import Rotation
    from lmcache_kv_fast.copy.fused_checks import BlockEngine

logger = logging.getLogger(__name__)

NAME = "native"

#: Results smaller than this come from torch.empty. From 1 MiB they come from the pool:
#: glibc serves such blocks from its heap once a freed mapping has raised its dynamic
#: mmap threshold, and there torch's 64-byte-aligned requests leave holes the next
#: identical request does not fit, so the heap grows with every such result. A pooled
#: result's pages are faulted for its own bytes only, not for its 2 MiB region's slack.
MIN_POOLED_RESULT_BYTES = 1 << 20


@dataclass(frozen=True)
class MappedRegion(Region):
    """A :class:`Region` inside a :class:`NativeSegment`'s mapping.

    Attributes:
        mapping: The mapping the region lies in; copies pin it (it is not unmapped while
            they run) and check the region against its bounds.
    """

    mapping: _native.Mapping | None = field(default=None, repr=False, compare=False)


class NativeSegment:
    """A POSIX SHM segment mapped read-write by the native core.

    Args:
        name: Segment name (``"x"`` or ``"/x"``; no other ``/``, no ``..``, no NUL).
        size: Minimum expected size in bytes (None: no check).
        populate: ``"background"`` (default): map the pages the segment already has from
            a background thread, window by window, so opening a large warm pool returns
            at once (a synchronous pre-fault takes time per resident GiB) and copies
            soon find their pages mapped; otherwise a pre-fault mode of
            :class:`_native.Mapping`, done before returning.

    Raises:
        ValueError: Bad name, empty segment, or smaller than ``size``.
        OSError: The segment cannot be opened (``FileNotFoundError``, ``PermissionError``).
    """

    #: Bytes mapped per step of the background pre-fault (it stops between steps).
    POPULATE_WINDOW = 64 << 20

    def __init__(self, name: str, size: int | None = None, populate: str = "background"
                 ) -> None:
        background = populate == "background"
        self._mapping = _native.Mapping(name, size, "none" if background else populate)
        self.name: str = self._mapping.name
        self.size: int = self._mapping.size
        self._stop = threading.Event()
        self._populater: threading.Thread | None = None
        if background:
            self._populater = threading.Thread(
                target=self._populate_resident, name=f"lmcache-kv-fast-prefault-{self.name}",
                daemon=True)
            self._populater.start()

    def _populate_resident(self) -> None:
        m, step = self._mapping, self.POPULATE_WINDOW
        try:
            for off in range(0, self.size, step):
                if self._stop.is_set():
                    return
                m.populate_resident(off, min(step, self.size - off))
        except ValueError:  # closed meanwhile
            return

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait for the background pre-fault to finish; True when it has."""
        t = self._populater
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._mapping.closed

    @property
    def mapping(self) -> _native.Mapping:
        """The underlying native mapping."""
        return self._mapping

    def regions(self, slots: Sequence[SlotLike], expected_nbytes: int,
                align: int) -> list[Region]:
        """See :class:`copy.base.Segment`."""
        offsets = [s.offset for s in slots]
        lengths = [s.length for s in slots]
        addrs = self._mapping.regions(offsets, lengths, expected_nbytes, align)
        m = self._mapping
        return [MappedRegion(a, ln, None, m) for a, ln in zip(addrs, lengths, strict=True)]

    def close(self) -> None:
        """Unmap (idempotent; deferred until running copies that use the segment end)."""
        self._stop.set()
        t = self._populater
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)  # at most one window (a few ms) after the stop
        self._mapping.close()

    def __enter__(self) -> NativeSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_segment(name: str, size: int | None = None) -> NativeSegment:
    """Map the segment ``name`` (see :class:`NativeSegment`)."""
    return NativeSegment(name, size)


def _shape4(t: torch.Tensor) -> tuple[int, int, int, int]:
    s = tuple(t.shape)
    return (1, *s) if len(s) == 3 else s  # type: ignore[return-value]


def _region_args(regions: Sequence[Region], what: str
                 ) -> tuple[list[int], list[int], list[Any] | None, list[torch.Tensor]]:
    """Split regions into addresses, lengths and owners; check tensor-backed ones.

    Returns:
        (addresses, lengths, owners or None, tensors to keep referenced during the copy).

    Raises:
        ValueError: A tensor-backed region is not covered by its tensor, or a region has
            neither a mapping nor a tensor.
    """
    addrs: list[int] = []
    lens: list[int] = []
    owners: list[Any] = []
    keep: list[torch.Tensor] = []
    any_owner = False
    for j, r in enumerate(regions):
        addr, nbytes = int(r.addr), int(r.nbytes)
        owner = getattr(r, "mapping", None)
        if owner is not None:
            any_owner = True
        elif r.tensor is not None:
            t = r.tensor
            if t.device.type != "cpu":
                raise ValueError(f"{what}: region {j} tensor is on {t.device}, not the CPU")
            base = t.data_ptr()
            isz = t.element_size()
            st = t.untyped_storage()  # what really backs it (its storage may have shrunk)
            backed = min(t.numel() * isz, st.nbytes() - t.storage_offset() * isz)
            if (not t.is_contiguous() or st.data_ptr() == 0 or addr < base
                    or addr + nbytes > base + backed):
                raise ValueError(
                    f"{what}: region {j} [{addr:#x}, +{nbytes}) is not covered by its tensor "
                    f"({t.numel() * isz} bytes at {base:#x}, {max(backed, 0)} of them in "
                    "its storage)"
                )
            keep.append(t)
        else:
            raise ValueError(
                f"{what}: region {j} carries neither a segment mapping nor a tensor; the "
                "native backend does not copy to or from unchecked raw addresses"
            )
        addrs.append(addr)
        lens.append(nbytes)
        owners.append(owner)
    return addrs, lens, (owners if any_owner else None), keep


def _copy(op: str, t: torch.Tensor, geom: ChunkGeometry, chunk_ids: Sequence[int],
          regions: Sequence[Region], col_offset: int, what: str) -> None:
    """Validate, then run ``_native.scatter`` (tensor → regions) or ``_native.gather``."""
    tokens = check_tensor_view(t, geom, col_offset, what)
    t = check_source(t, what) if op == "scatter" else check_destination(t, what)
    check_chunk_ids(chunk_ids, len(regions), tokens, geom.chunk_tokens, op)
    addrs, lens, owners, keep = _region_args(regions, op)
    if not addrs:
        return
    # The bytes that really back the tensor (its storage may be smaller than its shape if
    # it shrank since the check above ran; the core checks every run against this).
    backed = min(t.numel() * t.element_size(),
                 t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())
    try:
        getattr(_native, op)(t.data_ptr(), max(backed, 0), _shape4(t),
                             geom.itemsize, geom.width, col_offset, geom.chunk_tokens,
                             [int(i) for i in chunk_ids], addrs, lens, owners)
    except _native.TensorSpanError as err:
        raise InvalidArgumentError(f"{what}: {err}") from err
    del keep


def scatter(src: torch.Tensor, geom: ChunkGeometry, chunk_ids: Sequence[int],
            regions: Sequence[Region], col_offset: int = 0, *, what: str = "kv") -> None:
    """Copy chunk ``chunk_ids[j]`` of ``src`` into ``regions[j]`` for every j.

    ``src`` passes :func:`~copy.tensor_checks.check_source` (a neg/conj view is resolved
    first, so the regions get its logical values); ``what`` names it in errors.

    Raises:
        InvalidArgumentError: Bad tensor (view, storage smaller than its shape, freed).
        ValueError: Bad chunk ids or regions (nothing is copied then).
    """
    _copy("scatter", src, geom, chunk_ids, regions, col_offset, what)


def gather(dst: torch.Tensor, geom: ChunkGeometry, chunk_ids: Sequence[int],
           regions: Sequence[Region], col_offset: int = 0, *, what: str = "out") -> None:
    """Copy ``regions[j]`` into chunk ``chunk_ids[j]`` of ``dst`` for every j.

    ``dst`` passes :func:`~copy.tensor_checks.check_destination`; ``what`` names it in
    errors.

    Raises:
        InvalidArgumentError: Bad tensor (view, storage smaller than its shape, freed,
            negative / conjugate bit set).
        ValueError: Bad chunk ids or regions (nothing is copied then).
    """
    _copy("gather", dst, geom, chunk_ids, regions, col_offset, what)


def _tensor_span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage address, storage bytes, byte offset of t)`` (zeros for no elements)."""
    if t.numel() == 0:
        return 0, 0, 0
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes(), t.data_ptr() - st.data_ptr()


def fused_rows(src_regions: Sequence[Region], dst_chunk_ids: Sequence[int],
               dst_regions: Sequence[Region], index: torch.Tensor, geom: ChunkGeometry,
               rotation: Rotation | None = None, *, dtype: torch.dtype | None = None) -> None:
    """Gather token rows from chunk regions straight into other chunk regions.

    Source token ``s`` is row ``s % C`` of ``src_regions[s // C]``; ``dst_regions[j]``
    receives output chunk ``dst_chunk_ids[j]``, whose token ``t`` (of ``index``'s
    ``n_out``) takes source token ``index[t]``, on every plane and layer. With a
    ``rotation`` (tables ``[n_out, rotary_dim / 2]``), plane 0's rows are re-rotated as
    :func:`copy.edit_kernels.gather_tokens` does (bit for bit the torch math); ``dtype``
    names the rows' type then (None: bfloat16 for itemsize 2, float32 for 4). One pass
    on the copy threads without the GIL; regions as for :func:`scatter` (each at least
    ``geom.chunk_nbytes``). Output chunks not named are not touched.

    Raises:
        InvalidTypeError: ``index`` or a table is not a tensor, an id not an int.
        InvalidArgumentError: Bad index / tables / rotation geometry / dtype.
        ValueError: Bad regions, ids (count, range, repeats), index values, overlapping
            regions (before any byte moves).
    """
    index = check_index(index)
    n_out = index.numel()
    dt = rotation_dtype(rotation, geom, dtype)
    cos, sin = _tables(rotation, geom, n_out, "fused_rows")
    regions, keep = _fused_regions(src_regions, dst_chunk_ids, dst_regions, "fused_rows")
    _native.fused_rows(
        *regions, _tensor_span(index), n_out,
        (geom.planes, geom.layers, geom.chunk_tokens, geom.width, geom.itemsize),
        _tensor_span(cos), _tensor_span(sin), *_rotation_args(rotation),
        ROTATION_DTYPES[dt] if dt else "")
    del keep


def fused_blocks(src_regions: Sequence[Region], dst_chunk_ids: Sequence[int],
                 dst_regions: Sequence[Region], index: torch.Tensor, geom: ChunkGeometry,
                 engine: BlockEngine, rotation: Rotation | None = None) -> None:
    """:func:`fused_rows` for a CPU engine's raw chunk objects (``engine.raw_layout``).

    Each region holds one ``[L, C, NH*2*HS]`` object of the engine's raw rows (``geom``:
    one plane, ``width`` NH*2*HS, C whole engine blocks), where a token's K and V are
    scattered over its block (``layout.cpu_engine``). Output token ``t`` of
    ``dst_regions[j]`` (output chunk ``dst_chunk_ids[j]``) takes source token
    ``index[t]``'s K and V on every layer and head, K re-rotated by ``rotation``
    (``head_dim`` = HS; bit for bit the torch math) when given. Element positions come from
    ``engine.block_offsets()``. One pass on the copy threads without the GIL.

    Raises:
        InvalidTypeError: ``index`` or a table is not a tensor, an id not an int, no engine.
        InvalidArgumentError: Bad index / tables / rotation / dtype; ``geom`` not the
            engine's raw objects; an engine geometry without additive offsets.
        ValueError: Bad regions, ids, index values, overlapping regions (before any byte
            moves).
    """
    op = "fused_blocks"
    index = check_index(index, op)
    eng, tok_off, dim_off = check_block_engine(engine, geom, rotation)
    n_out = index.numel()
    dt = rotation_dtype(rotation, geom, eng.dtype, op)
    cos, sin = _tables(rotation, geom, n_out, op)
    regions, keep = _fused_regions(src_regions, dst_chunk_ids, dst_regions, op)
    _native.fused_blocks(
        *regions, _tensor_span(index), n_out,
        (geom.layers, geom.chunk_tokens, geom.width, geom.itemsize, eng.block_size,
         eng.head_dim),
        tok_off, dim_off,
        _tensor_span(cos), _tensor_span(sin), *_rotation_args(rotation),
        ROTATION_DTYPES[dt] if dt else "")
    del keep


def _tables(rotation: Rotation | None, geom: ChunkGeometry, n_out: int, op: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotation's checked ``(cos, sin)``, or two empty tables."""
    if rotation is not None:
        return check_rotation(rotation, geom, n_out, op)
    empty = torch.empty(0, dtype=torch.float32)
    return empty, empty


def _rotation_args(rotation: Rotation | None) -> tuple[int, int, bool]:
    """``(head_dim, rotary_dim, interleaved)`` for the core; zeros without a rotation."""
    if rotation is None:
        return 0, 0, False
    return rotation.head_dim, rotation.rotary_dim, bool(rotation.interleaved)


def _fused_regions(src_regions: Sequence[Region], dst_chunk_ids: Sequence[int],
                   dst_regions: Sequence[Region], op: str) -> tuple[tuple, list[torch.Tensor]]:
    """The core's region arguments of a fused gather and the tensors to keep referenced.

    Returns:
        ``((src addrs, lens, owners, dst ids, dst addrs, lens, owners), tensors)``.
    """
    try:
        ids = [int(operator.index(i)) for i in dst_chunk_ids]
    except TypeError as err:
        raise InvalidTypeError(f"{op}: destination chunk ids must be ints ({err})") from err
    s_addrs, s_lens, s_owners, keep_s = _region_args(src_regions, f"{op}: source")
    d_addrs, d_lens, d_owners, keep_d = _region_args(dst_regions, f"{op}: destination")
    return (s_addrs, s_lens, s_owners, ids, d_addrs, d_lens, d_owners), keep_s + keep_d


def alloc_result(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Allocate a contiguous CPU tensor for a gather to fill.

    Large results live in a native buffer: recycled from a bounded pool of already
    faulted buffers when one fits (capacities come in classes, so a 64 MiB read reuses
    the buffer of a 57.6 MiB edit), else a fresh 2 MiB-aligned mapping populated on the
    copy threads (``MADV_HUGEPAGE`` only with ``LMCACHE_KV_FAST_RESULT_THP=1``: on a VM
    that reports free memory to its host, huge pages often wait for the host to back
    them; ``csrc/result_buffer.cpp``). The tensor holds
    the buffer; it goes back to the pool when the last tensor/view over it dies. The
    tensor's storage is not resizable. Contents are uninitialised, as with torch.empty.
    """
    dims = tuple(int(s) for s in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in result shape {dims}")
    count = numel(dims)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_POOLED_RESULT_BYTES:
        return torch.empty(dims, dtype=dtype)
    buf = _native.ResultBuffer(nbytes)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(dims)


def reserve_results(nbytes: int, count: int) -> int:
    """Have ``count`` result buffers for ``nbytes``-byte results mapped and faulted ahead.

    For a caller that knows its next results' size while it waits for something else
    (a batched stream during the engine's prefill, before a modify): the buffers go into
    the result pool, so the results that follow (:func:`alloc_result`) take no page
    fault. Idle buffers already pooled that fit count; never beyond the pool's limit.
    Runs on the calling thread without the GIL. Results under
    ``MIN_POOLED_RESULT_BYTES`` are not pooled: nothing is reserved for them.

    Returns:
        Buffers mapped.

    Raises:
        ValueError: ``nbytes`` or ``count`` negative or too large.
    """
    if nbytes < 0 or count < 0:
        raise ValueError(f"reserve_results: expected nbytes, count >= 0, got {nbytes}, {count}")
    if nbytes < MIN_POOLED_RESULT_BYTES or count == 0:
        return 0
    return int(_native.result_pool_reserve(int(nbytes), int(count)))


def release_results() -> int:
    """Unmap the idle buffers of the result pool; return the bytes they held."""
    pooled = int(_native.result_pool_stats()["pooled_bytes"])
    _native.result_pool_trim()
    return pooled


def set_threads(n: int) -> None:
    """Set the number of copy threads (including the calling thread).

    Raises:
        InvalidArgumentError: ``n`` outside ``[1, MAX_COPY_THREADS]`` (1024, the core's
            ``_native.MAX_THREADS``); the message names ``copy_threads``.
        InvalidTypeError: ``n`` is not an int.
    """
    _native.set_threads(check_copy_threads(n))


def get_threads() -> int:
    """Return the number of copy threads."""
    return _native.get_threads()


def cap_call_threads(n: int) -> None:
    """Cap the calling thread's own copies at ``n`` threads (0: no cap; thread-local).

    Raises:
        InvalidArgumentError: ``n`` outside ``[0, MAX_COPY_THREADS]``.
        InvalidTypeError: ``n`` is not an int.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidTypeError(f"cap must be an int, got {type(n).__name__}")
    if not 0 <= n <= MAX_COPY_THREADS:
        raise InvalidArgumentError(f"cap must be in [0, {MAX_COPY_THREADS}] (0: none), got {n}")
    _native.set_call_threads(n)
