"""Argument checks of ``fused_rows`` and ``fused_blocks``, shared by the copy backends.

``fused_rows`` gathers token rows from one set of chunk regions straight into another
(``csrc/fused_rows.hpp`` says what moves where); ``fused_blocks`` does the same for a CPU
engine's raw blocks (``csrc/fused_blocks.hpp``). The native core validates the regions,
chunk ids and index values itself; these checks cover what only Python can see (tensor
types, dtypes, devices, layouts, the engine) and, for the torch reference, the rest too,
with the same meaning. ``op`` names the operation in messages.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch

from lmcache_kv_fast.copy.base import ChunkGeometry
from lmcache_kv_fast.copy.tensor_checks import check_source
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from lmcache_kv_fast.copy.edit_kernels import Rotation

__all__ = ["ROTATION_DTYPES", "BlockEngine", "check_block_engine", "check_dst_chunk_ids",
           "check_index", "check_overlaps", "check_rotation", "rotation_dtype"]

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


def check_index(index: object, op: str = "fused_rows") -> torch.Tensor:
    """The index: a contiguous int64 CPU tensor ``[n_out]`` (neg bit resolved).

    Raises:
        InvalidTypeError: Not a tensor.
        InvalidArgumentError: Wrong dtype, device, layout or rank.
    """
    t = _dense(index, torch.int64, f"{op}: index")
    if t.dim() != 1:
        raise InvalidArgumentError(
            f"{op}: index must be 1-D [n_out], got shape {list(t.shape)}")
    return t


def rotation_dtype(rotation: Rotation | None, geom: ChunkGeometry,
                   dtype: torch.dtype | None, op: str = "fused_rows") -> torch.dtype | None:
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
                f"{op}: a rotation needs bfloat16 or float32 rows (itemsize 2 or 4), "
                f"got itemsize {geom.itemsize}")
    if dtype not in ROTATION_DTYPES:
        raise InvalidArgumentError(
            f"{op}: a rotation needs bfloat16 or float32 rows, got {dtype}")
    if dtype.itemsize != geom.itemsize:
        raise InvalidArgumentError(
            f"{op}: dtype {dtype} has itemsize {dtype.itemsize}, the geometry "
            f"{geom.itemsize}")
    return dtype


def check_rotation(rotation: Rotation, geom: ChunkGeometry, n_out: int,
                   op: str = "fused_rows") -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's geometry and tables; returns ``(cos, sin)`` (neg bits resolved).

    Raises:
        InvalidTypeError: cos / sin not tensors.
        InvalidArgumentError: ``width % head_dim``, an odd or too wide ``rotary_dim``,
            tables not contiguous float32 CPU ``[n_out, rotary_dim / 2]``.
    """
    hd, rd = operator.index(rotation.head_dim), operator.index(rotation.rotary_dim)
    if hd <= 0 or geom.width % hd:
        raise InvalidArgumentError(
            f"{op}: width {geom.width} is not a whole number of heads of {hd}")
    if rd <= 0 or rd % 2 or rd > hd:
        raise InvalidArgumentError(
            f"{op}: rotary_dim must be even, >= 2 and at most head_dim {hd}, got {rd}")
    tables = []
    for name in ("cos", "sin"):
        t = _dense(getattr(rotation, name), torch.float32, f"{op}: rotation.{name}")
        if tuple(t.shape) != (n_out, rd // 2):
            raise InvalidArgumentError(
                f"{op}: rotation.{name} has shape {list(t.shape)}, expected "
                f"[{n_out}, {rd // 2}] (n_out, rotary_dim / 2)")
        tables.append(t)
    return tables[0], tables[1]


def check_dst_chunk_ids(ids: Sequence[int], n_dst: int, n_out: int, chunk_tokens: int,
                        op: str = "fused_rows") -> list[int]:
    """Destination chunk ids: one per region, unique, inside the index; returned as ints.

    Raises:
        InvalidTypeError: An id is not an integer.
        InvalidArgumentError: Count, range or a repeated id.
    """
    try:
        out = [operator.index(i) for i in ids]
    except TypeError as err:
        raise InvalidTypeError(f"{op}: destination chunk ids must be ints ({err})") from err
    if len(out) != n_dst:
        raise InvalidArgumentError(
            f"{op}: {len(out)} destination chunk ids for {n_dst} destination regions")
    for j, i in enumerate(out):
        if i < 0 or (i + 1) * chunk_tokens > n_out:
            raise InvalidArgumentError(
                f"{op}: destination chunk id {j} is {i}, expected one in "
                f"[0, {n_out // chunk_tokens}) (index of {n_out} tokens, {chunk_tokens} a chunk)")
    if len(set(out)) != len(out):
        dup = next(i for i in out if out.count(i) > 1)
        raise InvalidArgumentError(f"{op}: destination chunk id {dup} appears twice")
    return out


def check_overlaps(src_addrs: Sequence[int], dst_addrs: Sequence[int], nbytes: int,
                   op: str = "fused_rows") -> None:
    """No destination chunk (``nbytes`` from its address) overlaps another or a source.

    Raises:
        InvalidArgumentError: Naming the two regions.
    """
    dst = sorted((a, j) for j, a in enumerate(dst_addrs))
    for (a, i), (b, j) in itertools.pairwise(dst):
        if b < a + nbytes:
            raise InvalidArgumentError(f"{op}: destination regions {i} and {j} overlap")
    starts = [a for a, _ in dst]
    for k, s in enumerate(src_addrs):
        i = bisect.bisect_left(starts, s + nbytes)  # the last destination starting before
        if i and starts[i - 1] + nbytes > s:       # the source's end reaches furthest
            raise InvalidArgumentError(
                f"{op}: destination region {dst[i - 1][1]} overlaps source region {k}")


class BlockEngine(Protocol):
    """What ``fused_blocks`` uses of a CPU engine's KV geometry (``layout.CpuEngineKV``).

    Typed structurally: ``copy/`` sits below ``layout/`` and does not import it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    kernel: str

    def block_offsets(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """int64 ``(tok_off [2, BS], dim_off [2, HS])``, or None."""

    def to_tokens(self, raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Raw rows ``[L, T, NH*2*HS]`` -> per-token ``[2, L, T, NH*HS]``."""

    def to_raw(self, kv: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token ``[2, L, T, NH*HS]`` -> raw rows ``[L, T, NH*2*HS]``."""


def _offset_lists(e: BlockEngine) -> tuple[Sequence[int], Sequence[int]] | None:
    """``e``'s ``(tok_off, dim_off)`` flattened: its shared lists when it has them."""
    shared = getattr(e, "block_offset_lists", None)
    if callable(shared):
        return cast("tuple[Sequence[int], Sequence[int]] | None", shared())
    tables = e.block_offsets()
    return None if tables is None else (tables[0].reshape(-1).tolist(),
                                         tables[1].reshape(-1).tolist())


def check_block_engine(engine: object, geom: ChunkGeometry, rotation: Rotation | None
                       ) -> tuple[BlockEngine, Sequence[int], Sequence[int]]:
    """The engine and its flat offset tables, after checking ``geom`` and the rotation.

    ``geom`` must describe the engine's raw objects: one plane, its layers, ``width`` =
    ``NH*2*HS``, its itemsize, whole blocks per chunk; a rotation's ``head_dim`` is HS.

    Raises:
        InvalidTypeError: ``engine`` has no ``block_offsets``.
        InvalidArgumentError: A mismatch, or an engine geometry without additive offsets.
    """
    if not callable(getattr(engine, "block_offsets", None)):
        raise InvalidTypeError(
            f"fused_blocks: engine must be a CpuEngineKV, got {type(engine).__name__}")
    e = cast(BlockEngine, engine)
    want = (1, e.num_layers, e.num_kv_heads * 2 * e.head_dim, e.dtype.itemsize)
    got = (geom.planes, geom.layers, geom.width, geom.itemsize)
    if got != want:
        raise InvalidArgumentError(
            f"fused_blocks: geometry (planes, layers, width, itemsize) {got} is not the "
            f"engine's raw objects' {want}")
    if geom.chunk_tokens % e.block_size:
        raise InvalidArgumentError(
            f"fused_blocks: chunk_tokens {geom.chunk_tokens} is not a multiple of the "
            f"engine's block_size {e.block_size}")
    if rotation is not None and operator.index(rotation.head_dim) != e.head_dim:
        raise InvalidArgumentError(
            f"fused_blocks: the rotation's head_dim {rotation.head_dim} is not the engine's "
            f"head_dim {e.head_dim}")
    tables = _offset_lists(e)
    if tables is None:
        raise InvalidArgumentError(
            f"fused_blocks: the {e.kernel} kernel's order with block_size {e.block_size} and "
            f"head_dim {e.head_dim} has no additive block offsets (to_raw takes two copies "
            "there); move its tokens with to_tokens / to_raw")
    return e, tables[0], tables[1]
