"""Argument checks of ``fused_rows``, shared by the copy backends.

``fused_rows`` gathers token rows from one set of chunk regions straight into another
(``csrc/fused_rows.hpp`` says what moves where). The native core validates the regions,
chunk ids and index values itself; these checks cover what only Python can see (tensor
types, dtypes, devices, layouts) and, for the torch reference, the rest too, with the
same meaning.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache_kv_fast.copy.base import ChunkGeometry
from lmcache_kv_fast.copy.tensor_checks import check_source
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from lmcache_kv_fast.copy.edit_kernels import Rotation

__all__ = ["ROTATION_DTYPES", "check_dst_chunk_ids", "check_index", "check_overlaps",
           "check_rotation", "rotation_dtype"]

#: Element types a rotation computes in, by name (the core's names).
ROTATION_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_BY_ITEMSIZE = {2: torch.bfloat16, 4: torch.float32}


def _dense(t: object, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype`` (neg/conj resolved), or an error."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.device.type != "cpu" or t.layout != torch.strided or \
            not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what} must be a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}"
            f"{'' if t.layout != torch.strided or t.is_contiguous() else ' (not contiguous)'}")
    return check_source(t, what)


def check_index(index: object) -> torch.Tensor:
    """The index: a contiguous int64 CPU tensor ``[n_out]`` (neg bit resolved).

    Raises:
        InvalidTypeError: Not a tensor.
        InvalidArgumentError: Wrong dtype, device, layout or rank.
    """
    t = _dense(index, torch.int64, "fused_rows: index")
    if t.dim() != 1:
        raise InvalidArgumentError(
            f"fused_rows: index must be 1-D [n_out], got shape {list(t.shape)}")
    return t


def rotation_dtype(rotation: Rotation | None, geom: ChunkGeometry,
                   dtype: torch.dtype | None) -> torch.dtype | None:
    """The element type a rotation computes in (None without a rotation).

    ``dtype`` names it; None takes it from ``geom.itemsize`` (2: bfloat16, 4: float32).

    Raises:
        InvalidArgumentError: A dtype the rotation cannot run, or not ``geom.itemsize``.
    """
    if rotation is None:
        return None
    if dtype is None:
        dtype = _BY_ITEMSIZE.get(geom.itemsize)
        if dtype is None:
            raise InvalidArgumentError(
                f"fused_rows: a rotation needs bfloat16 or float32 rows (itemsize 2 or 4), "
                f"got itemsize {geom.itemsize}")
    if dtype not in ROTATION_DTYPES:
        raise InvalidArgumentError(
            f"fused_rows: a rotation needs bfloat16 or float32 rows, got {dtype}")
    if dtype.itemsize != geom.itemsize:
        raise InvalidArgumentError(
            f"fused_rows: dtype {dtype} has itemsize {dtype.itemsize}, the geometry "
            f"{geom.itemsize}")
    return dtype


def check_rotation(rotation: Rotation, geom: ChunkGeometry,
                   n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's geometry and tables; returns ``(cos, sin)`` (neg bits resolved).

    Raises:
        InvalidTypeError: cos / sin not tensors.
        InvalidArgumentError: ``width % head_dim``, an odd or too wide ``rotary_dim``,
            tables not contiguous float32 CPU ``[n_out, rotary_dim / 2]``.
    """
    hd, rd = operator.index(rotation.head_dim), operator.index(rotation.rotary_dim)
    if hd <= 0 or geom.width % hd:
        raise InvalidArgumentError(
            f"fused_rows: width {geom.width} is not a whole number of heads of {hd}")
    if rd <= 0 or rd % 2 or rd > hd:
        raise InvalidArgumentError(
            f"fused_rows: rotary_dim must be even, >= 2 and at most head_dim {hd}, got {rd}")
    tables = []
    for name in ("cos", "sin"):
        t = _dense(getattr(rotation, name), torch.float32, f"fused_rows: rotation.{name}")
        if tuple(t.shape) != (n_out, rd // 2):
            raise InvalidArgumentError(
                f"fused_rows: rotation.{name} has shape {list(t.shape)}, expected "
                f"[{n_out}, {rd // 2}] (n_out, rotary_dim / 2)")
        tables.append(t)
    return tables[0], tables[1]


def check_dst_chunk_ids(ids: Sequence[int], n_dst: int, n_out: int, chunk_tokens: int
                    ) -> list[int]:
    """Destination chunk ids: one per region, unique, inside the index; returned as ints.

    Raises:
        InvalidTypeError: An id is not an integer.
        InvalidArgumentError: Count, range or a repeated id.
    """
    try:
        out = [operator.index(i) for i in ids]
    except TypeError as err:
        raise InvalidTypeError(f"fused_rows: destination chunk ids must be ints ({err})") from err
    if len(out) != n_dst:
        raise InvalidArgumentError(
            f"fused_rows: {len(out)} destination chunk ids for {n_dst} destination regions")
    for j, i in enumerate(out):
        if i < 0 or (i + 1) * chunk_tokens > n_out:
            raise InvalidArgumentError(
                f"fused_rows: destination chunk id {j} is {i}, expected one in "
                f"[0, {n_out // chunk_tokens}) (index of {n_out} tokens, {chunk_tokens} a chunk)")
    if len(set(out)) != len(out):
        dup = next(i for i in out if out.count(i) > 1)
        raise InvalidArgumentError(f"fused_rows: destination chunk id {dup} appears twice")
    return out


def check_overlaps(src_addrs: Sequence[int], dst_addrs: Sequence[int], nbytes: int) -> None:
    """No destination chunk (``nbytes`` from its address) overlaps another or a source.

    Raises:
        InvalidArgumentError: Naming the two regions.
    """
    dst = sorted((a, j) for j, a in enumerate(dst_addrs))
    for (a, i), (b, j) in itertools.pairwise(dst):
        if b < a + nbytes:
            raise InvalidArgumentError(f"fused_rows: destination regions {i} and {j} overlap")
    starts = [a for a, _ in dst]
    for k, s in enumerate(src_addrs):
        i = bisect.bisect_left(starts, s + nbytes)  # the last destination starting before
        if i and starts[i - 1] + nbytes > s:       # the source's end reaches furthest
            raise InvalidArgumentError(
                f"fused_rows: destination region {dst[i - 1][1]} overlaps source region {k}")
