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

import torch

from lmcache_kv_fast.copy.base import (
    ChunkGeometry,
    Region,
    SlotLike,
    check_chunk_ids,
    check_copy_threads,
    check_tensor_view,
)
from lmcache_kv_fast.copy.tensor_checks import check_destination, check_source, check_storage

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
