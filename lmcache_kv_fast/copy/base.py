"""Types shared by the copy backends.

A KV tensor is viewed as ``[P, L, T, Dfull]`` (``P`` planes: 2 for K/V, 1 for MLA), C-order.
The server stores one object per chunk of ``C`` tokens, ``[P, L, C, W]`` contiguous, where
``W`` is the copied width (``Dfull``, or one tensor-parallel shard's ``Dfull / world_size``
starting at column ``col_offset``). Chunk ``i`` of the tensor is tokens ``[i*C, (i+1)*C)``.
So one chunk is ``P*L`` runs of ``C`` rows of ``W*itemsize`` bytes on the tensor side
(one run of ``C*W*itemsize`` bytes when ``W == Dfull``) and one contiguous region on the
server side.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

#: Most copy threads a backend accepts (the native core's limit, ``_native.MAX_THREADS``:
#: CPU_SETSIZE, the most CPUs an affinity mask names; the pool creates every requested
#: thread on the next large copy, so a huge count would exhaust the thread limits).
MAX_COPY_THREADS = 1024


@dataclass(frozen=True)
class ChunkGeometry:
    """Geometry of one chunk object.

    Attributes:
        planes: P, 2 (K and V) or 1 (single plane / MLA).
        layers: L.
        chunk_tokens: C, tokens per chunk.
        width: W, elements per token row of one object (per shard).
        itemsize: bytes per element.
    """

    planes: int
    layers: int
    chunk_tokens: int
    width: int
    itemsize: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of the object."""
        return self.width * self.itemsize

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk object."""
        return self.planes * self.layers * self.chunk_tokens * self.row_bytes

    def object_shape(self) -> tuple[int, ...]:
        """Shape of one chunk object, ``[P, L, C, W]``."""
        return (self.planes, self.layers, self.chunk_tokens, self.width)


@dataclass(frozen=True)
class Region:
    """Contiguous bytes of one chunk on the server side (an SHM slot or a pickle tensor).

    Attributes:
        addr: Absolute address of the first byte.
        nbytes: Length in bytes.
        tensor: A flat uint8 tensor over the same bytes (torch backend), or None.
    """

    addr: int
    nbytes: int
    tensor: torch.Tensor | None = None

    @classmethod
    def of_tensor(cls, t: torch.Tensor) -> Region:
        """Region over a contiguous CPU tensor's bytes."""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("a region tensor must be a contiguous CPU tensor")
        flat = t.reshape(-1).view(torch.uint8)
        return cls(t.data_ptr(), t.numel() * t.element_size(), flat)


class SlotLike(Protocol):
    """Anything with ``offset`` and ``length`` (e.g. :class:`protocol.types.Slot`)."""

    offset: int
    length: int


class Segment(Protocol):
    """A mapped POSIX shared-memory segment (the server's L1 pool)."""

    name: str
    size: int

    def regions(self, slots: Sequence[SlotLike], expected_nbytes: int, align: int) -> list[Region]:
        """Validate slots against the mapping and return their regions.

        Raises:
            ValueError: A slot is outside the segment, misaligned, of the wrong length,
                or overlaps another slot of the same call.
        """
        ...

    def close(self) -> None:
        """Unmap. Idempotent."""
        ...


def check_copy_threads(n: Any, what: str = "copy_threads") -> int:
    """Return ``n`` as an int in ``[1, MAX_COPY_THREADS]``.

    Raises:
        InvalidTypeError: ``n`` is not an integer (or is a bool).
        InvalidArgumentError: ``n`` is outside the range.
    """
    if isinstance(n, bool):
        raise InvalidTypeError(f"{what} must be an int, got {n!r}")
    try:
        v = operator.index(n)
    except TypeError as err:
        raise InvalidTypeError(f"{what} must be an int, got {type(n).__name__}") from err
    if not 1 <= v <= MAX_COPY_THREADS:
        raise InvalidArgumentError(
            f"{what} must be in [1, {MAX_COPY_THREADS}] (at most one thread per CPU an "
            f"affinity mask can name), got {v}"
        )
    return v


def check_tensor_view(t: torch.Tensor, geom: ChunkGeometry, col_offset: int, what: str) -> int:
    """Check ``t`` can be addressed as ``[P, L, T, Dfull]`` for ``geom``; return T.

    Raises:
        InvalidArgumentError: Wrong rank/shape/dtype size, not contiguous, or not on the
            CPU (also a ValueError).
    """
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{what} must be a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what} must be contiguous")
    if t.element_size() != geom.itemsize:
        raise InvalidArgumentError(
            f"{what} has itemsize {t.element_size()}, expected {geom.itemsize}")
    shape = tuple(t.shape)
    if len(shape) == 3:
        shape = (1, *shape)
    if len(shape) != 4 or shape[0] != geom.planes or shape[1] != geom.layers:
        raise InvalidArgumentError(
            f"{what} has shape {tuple(t.shape)}, expected [{geom.planes}, {geom.layers}, T, D]"
        )
    if col_offset < 0 or col_offset + geom.width > shape[3]:
        raise InvalidArgumentError(
            f"{what}: columns [{col_offset}, {col_offset + geom.width}) exceed D={shape[3]}"
        )
    return shape[2]


def check_chunk_ids(chunk_ids: Sequence[int], n_regions: int, tensor_tokens: int,
                    chunk_tokens: int, what: str) -> None:
    """Check chunk indices are within the tensor and match the region count.

    Raises:
        ValueError: On a count mismatch or an index out of range.
    """
    if len(chunk_ids) != n_regions:
        raise ValueError(f"{what}: {len(chunk_ids)} chunk ids for {n_regions} regions")
    n_chunks = tensor_tokens // chunk_tokens
    for i in chunk_ids:
        if not 0 <= int(i) < n_chunks:
            raise ValueError(f"{what}: chunk index {i} outside [0, {n_chunks})")


def numel(shape: Sequence[int]) -> int:
    """Product of ``shape``."""
    return math.prod(shape)
