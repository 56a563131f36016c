"""Pure-torch copy backend: the reference for parity tests and the fallback.

Copies with ``Tensor.copy_`` on views; the segment is a Python ``mmap`` exposed as one
uint8 tensor. The KV tensor and the region tensors pass :mod:`copy.tensor_checks` like
in the native backend (torch refuses views past a shrunk storage with a RuntimeError
only when it builds them; the checks give the same InvalidArgumentError as the native
backend, and the same neg/conj semantics).
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache_kv_fast.copy.base import (
    ChunkGeometry,
    Region,
    SlotLike,
    check_chunk_ids,
    check_copy_threads,
    check_tensor_view,
)
from lmcache_kv_fast.copy.fused_checks import (
    check_block_engine,
    check_dst_chunk_ids,
    check_index,
    check_overlaps,
    check_rotation,
    rotation_dtype,
)
from lmcache_kv_fast.copy.rotate_pairs import rotate_pairs
from lmcache_kv_fast.copy.tensor_checks import check_destination, check_source, check_storage
from lmcache_kv_fast.errors import InvalidArgumentError

if TYPE_CHECKING:
    from lmcache_kv_fast.copy.edit_kernels import Rotation
    from lmcache_kv_fast.copy.fused_checks import BlockEngine

NAME = "torch"


def _as4d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 3 else t


class TorchSegment:
    """A POSIX SHM segment mapped with Python's ``mmap`` and viewed as a uint8 tensor."""

    def __init__(self, name: str, size: int | None = None) -> None:
        self.name = validate_segment_name(name)
        fd = os.open(f"/dev/shm/{self.name}", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)  # as shm_open
        try:
            real = os.fstat(fd).st_size
            if size is not None and size > real:
                raise ValueError(f"segment {self.name} has {real} bytes, expected >= {size}")
            self.size = real
            self._mm: mmap.mmap | None = mmap.mmap(fd, real, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd  # kept to see the file shrink (a copy there is SIGBUS)
        self._flat: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    def regions(self, slots: Sequence[SlotLike], expected_nbytes: int, align: int) -> list[Region]:
        """See :class:`copy.base.Segment`."""
        if self._flat is None:
            raise ValueError(f"segment {self.name} is closed")
        limit = min(self.size, os.fstat(self._fd).st_size) if self._fd is not None else 0
        spans = validate_slots(slots, limit, expected_nbytes, align)
        base = self._flat.data_ptr()
        return [Region(base + off, ln, self._flat[off:off + ln]) for off, ln in spans]

    def close(self) -> None:
        """Unmap (idempotent)."""
        self._flat = None
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a region view is still alive somewhere; let GC unmap
                pass
            self._mm = None


def validate_segment_name(name: str) -> str:
    """Return the bare POSIX name; refuse names that could escape ``/dev/shm``.

    Raises:
        ValueError: Empty, containing ``/`` (after one leading slash), ``..`` or NUL.
    """
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or ".." in bare or "\x00" in bare or len(bare) > 255:
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return bare


def validate_slots(slots: Sequence[SlotLike], size: int, expected_nbytes: int,
                   align: int) -> list[tuple[int, int]]:
    """Bounds/alignment/length/overlap check of slot descriptors; return (offset, length).

    Raises:
        ValueError: On the first bad slot, naming it.
    """
    spans: list[tuple[int, int]] = []
    for k, s in enumerate(slots):
        off, ln = int(s.offset), int(s.length)
        if ln != expected_nbytes:
            raise ValueError(f"slot {k}: length {ln}, expected {expected_nbytes}")
        if off < 0 or off + ln > size:
            raise ValueError(f"slot {k}: [{off}, {off + ln}) outside the segment of {size} bytes")
        if align > 0 and off % align:
            raise ValueError(f"slot {k}: offset {off} not aligned to {align}")
        spans.append((off, ln))
    ordered = sorted(spans)
    for (a_off, a_ln), (b_off, _) in itertools.pairwise(ordered):
        if b_off < a_off + a_ln:
            raise ValueError(f"slots overlap at offsets {a_off} and {b_off}")
    return spans


def open_segment(name: str, size: int | None = None) -> TorchSegment:
    """Map the segment ``name`` (see :class:`TorchSegment`)."""
    return TorchSegment(name, size)


def _region_views(regions: Sequence[Region], geom: ChunkGeometry, dtype: torch.dtype,
                  what: str) -> list[torch.Tensor]:
    """Each region's tensor as a ``[P, L, C, W]`` view, after checking its storage."""
    views = []
    for j, r in enumerate(regions):
        if r.tensor is None:
            raise ValueError("the torch backend needs regions that carry a tensor view")
        if r.nbytes != geom.chunk_nbytes:
            raise ValueError(f"region of {r.nbytes} bytes, expected {geom.chunk_nbytes}")
        check_storage(r.tensor, f"{what}: region {j}")
        views.append(r.tensor.view(dtype).view(geom.object_shape()))
    return views


def scatter(src: torch.Tensor, geom: ChunkGeometry, chunk_ids: Sequence[int],
            regions: Sequence[Region], col_offset: int = 0, *, what: str = "kv") -> None:
    """Copy chunk ``chunk_ids[j]`` of ``src`` into ``regions[j]`` for every j.

    Raises:
        InvalidArgumentError: Bad tensor (see the native backend's ``scatter``).
        ValueError: Bad chunk ids or regions (nothing is copied then).
    """
    tokens = check_tensor_view(src, geom, col_offset, what)
    src = check_source(src, what)
    check_chunk_ids(chunk_ids, len(regions), tokens, geom.chunk_tokens, "scatter")
    views = _region_views(regions, geom, src.dtype, "scatter")
    s4 = _as4d(src)
    c, w = geom.chunk_tokens, geom.width
    for i, v in zip(chunk_ids, views, strict=True):
        v.copy_(s4[:, :, i * c:(i + 1) * c, col_offset:col_offset + w])


def gather(dst: torch.Tensor, geom: ChunkGeometry, chunk_ids: Sequence[int],
           regions: Sequence[Region], col_offset: int = 0, *, what: str = "out") -> None:
    """Copy ``regions[j]`` into chunk ``chunk_ids[j]`` of ``dst`` for every j.

    Raises:
        InvalidArgumentError: Bad tensor (see the native backend's ``gather``).
        ValueError: Bad chunk ids or regions (nothing is copied then).
    """
    tokens = check_tensor_view(dst, geom, col_offset, what)
    check_destination(dst, what)
    check_chunk_ids(chunk_ids, len(regions), tokens, geom.chunk_tokens, "gather")
    views = _region_views(regions, geom, dst.dtype, "gather")
    d4 = _as4d(dst)
    c, w = geom.chunk_tokens, geom.width
    for i, v in zip(chunk_ids, views, strict=True):
        d4[:, :, i * c:(i + 1) * c, col_offset:col_offset + w].copy_(v)


def _chunk_views(regions: Sequence[Region], geom: ChunkGeometry, dtype: torch.dtype | None,
                 what: str, op: str = "fused_rows") -> list[torch.Tensor]:
    """Each region's first chunk as ``[P, L, C, W]`` of ``dtype`` (None: bytes, W * itemsize)."""
    views = []
    for j, r in enumerate(regions):
        if r.tensor is None:
            raise InvalidArgumentError(f"{op}: {what} region {j} carries no tensor view")
        if r.nbytes < geom.chunk_nbytes:
            raise InvalidArgumentError(
                f"{op}: {what} region {j} holds {r.nbytes} bytes, expected at least "
                f"{geom.chunk_nbytes} (one {list(geom.object_shape())} x {geom.itemsize} chunk)")
        check_storage(r.tensor, f"{op}: {what} region {j}")
        flat = r.tensor.reshape(-1).view(torch.uint8)[:geom.chunk_nbytes]
        shape = geom.object_shape()
        views.append(flat.view(dtype).view(shape) if dtype is not None else
                     flat.view(*shape[:3], geom.row_bytes))
    return views


def _rotate_plane(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rotation: Rotation) -> None:
    """Rotate ``x`` ``[L, C, W]`` in place, row ``t`` by ``cos[t]``, ``sin[t]``.

    The math of ``edits.rerotate`` (float32 ``mul``, then ``addcmul_``), so the bytes equal.
    """
    layers, count, width = x.shape
    k = x.view(layers, count, width // rotation.head_dim, rotation.head_dim)
    rd, half = rotation.rotary_dim, rotation.rotary_dim // 2
    if rotation.interleaved:
        x1, x2 = k[..., 0:rd:2], k[..., 1:rd:2]
    else:
        x1, x2 = k[..., :half], k[..., half:rd]
    rotate_pairs(x1, x2, cos[:, None, :], sin[:, None, :])


def fused_rows(src_regions: Sequence[Region], dst_chunk_ids: Sequence[int],
               dst_regions: Sequence[Region], index: torch.Tensor, geom: ChunkGeometry,
               rotation: Rotation | None = None, *, dtype: torch.dtype | None = None) -> None:
    """Gather token rows from chunk regions into other chunk regions (torch reference).

    See the native backend's ``fused_rows``: the same bytes, the same checks (before any
    byte moves), computed with ``index_select`` on the assembled source.

    Raises:
        InvalidTypeError: ``index`` or a table is not a tensor, an id not an int.
        InvalidArgumentError: Bad index, tables, rotation, dtype, regions, ids, index
            values or overlapping regions (also ValueErrors).
    """
    index = check_index(index)
    n_out, c = index.numel(), geom.chunk_tokens
    dt = rotation_dtype(rotation, geom, dtype)
    tables = check_rotation(rotation, geom, n_out) if rotation is not None else None
    ids = check_dst_chunk_ids(dst_chunk_ids, len(dst_regions), n_out, c)
    srcs = _chunk_views(src_regions, geom, dt, "source")
    dsts = _chunk_views(dst_regions, geom, dt, "destination")
    check_overlaps([v.data_ptr() for v in srcs], [v.data_ptr() for v in dsts], geom.chunk_nbytes)
    _check_index_values(index, len(srcs), c, "fused_rows")
    if not dsts:
        return
    full = torch.cat(srcs, dim=2)
    outs = []
    for i in ids:
        out = full.index_select(2, index[i * c:(i + 1) * c])
        if rotation is not None and tables is not None:
            _rotate_plane(out[0], tables[0][i * c:(i + 1) * c], tables[1][i * c:(i + 1) * c],
                          rotation)
        outs.append(out)
    for v, out in zip(dsts, outs, strict=True):
        v.copy_(out)


def _check_index_values(index: torch.Tensor, n_src: int, c: int, op: str) -> None:
    """Every index value names a token of the ``n_src`` source chunks of ``c`` tokens.

    Raises:
        InvalidArgumentError: Naming the first value outside.
    """
    n_rows = n_src * c
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n_rows):
        bad = int(((index < 0) | (index >= n_rows)).nonzero()[0, 0])
        raise InvalidArgumentError(
            f"{op}: index {bad} is {int(index[bad])}, outside [0, {n_rows}) "
            f"({n_src} source chunks of {c} tokens)")


def fused_blocks(src_regions: Sequence[Region], dst_chunk_ids: Sequence[int],
                 dst_regions: Sequence[Region], index: torch.Tensor, geom: ChunkGeometry,
                 engine: BlockEngine, rotation: Rotation | None = None) -> None:
    """The native backend's ``fused_blocks`` computed the long way (torch reference).

    Each source chunk becomes per-token K/V (``engine.to_tokens``), :func:`fused_rows`
    moves (and turns) those tokens into per-token output chunks, and ``engine.to_raw``
    writes them into the destination regions. The same checks first (before any byte
    moves), with the same meaning.

    Raises:
        InvalidTypeError: ``index`` or a table is not a tensor, an id not an int, no engine.
        InvalidArgumentError: Bad index, tables, rotation, dtype, engine geometry, regions,
            ids, index values or overlapping regions.
    """
    op = "fused_blocks"
    index = check_index(index, op)
    eng, _, _ = check_block_engine(engine, geom, rotation)
    n_out, c = index.numel(), geom.chunk_tokens
    rotation_dtype(rotation, geom, eng.dtype, op)
    if rotation is not None:
        check_rotation(rotation, geom, n_out, op)
    ids = check_dst_chunk_ids(dst_chunk_ids, len(dst_regions), n_out, c, op)
    srcs = _chunk_views(src_regions, geom, eng.dtype, "source", op)
    dsts = _chunk_views(dst_regions, geom, eng.dtype, "destination", op)
    check_overlaps([v.data_ptr() for v in srcs], [v.data_ptr() for v in dsts], geom.chunk_nbytes,
                   op)
    _check_index_values(index, len(srcs), c, op)
    if not dsts:
        return
    tok_geom = ChunkGeometry(2, geom.layers, c, eng.num_kv_heads * eng.head_dim, geom.itemsize)
    tok_srcs = [eng.to_tokens(v[0]) for v in srcs]
    tok_dsts = [torch.empty(tok_geom.object_shape(), dtype=eng.dtype) for _ in ids]
    fused_rows([Region.of_tensor(t) for t in tok_srcs], ids,
               [Region.of_tensor(t) for t in tok_dsts], index, tok_geom, rotation, dtype=eng.dtype)
    for v, t in zip(dsts, tok_dsts, strict=True):
        eng.to_raw(t, out=v[0])


def alloc_result(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Allocate a fresh result tensor."""
    return torch.empty(tuple(shape), dtype=dtype)


def reserve_results(nbytes: int, count: int) -> int:
    """Nothing to reserve (torch allocates every result afresh); checks the arguments.

    Raises:
        ValueError: ``nbytes`` or ``count`` negative.
    """
    if nbytes < 0 or count < 0:
        raise ValueError(f"reserve_results: expected nbytes, count >= 0, got {nbytes}, {count}")
    return 0


def release_results() -> int:
    """Nothing is pooled: 0 bytes released."""
    return 0


def set_threads(n: int) -> None:
    """Check ``n`` like the native backend does; otherwise a no-op (torch's own threads).

    Raises:
        InvalidArgumentError: ``n`` outside ``[1, MAX_COPY_THREADS]``.
        InvalidTypeError: ``n`` is not an int.
    """
    check_copy_threads(n)


def get_threads() -> int:
    """Return torch's intra-op thread count."""
    return torch.get_num_threads()


def cap_call_threads(n: int) -> None:
    """A no-op: torch's thread count is process-wide, not the calling thread's."""
