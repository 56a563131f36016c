"""Per-token K/V from a CPU vLLM engine's raw KV rows, and back.

vLLM's CPU attention backend keeps one cache tensor per layer,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, and inside each
``(block, kv_head)`` region of ``block_size * 2 * head_size`` elements the attention
kernel keeps its own element order (``docs/engine-kv-layout.md``):

* ``vec`` / ``vec16`` (x86 AVX-512/AVX2, any float dtype): K transposed
  (``[head_size, block_size]``), then V (``[block_size, head_size]``).
* ``amx`` (x86 AMX, bfloat16 only): K as ``[block_size/16, head_size/2, 16, 2]``
  (``[t//16, d//2, t%16, d%2]``), then V as ``[head_size/16, block_size/2, 16, 2]``
  (``[d//16, t//2, d%16, t%2]``).

LMCache detects that cache as the fused single-plane format ``NL_X_NB_NH_BS_CS`` and
stores rows ``[L, T, NH * 2 * HS]`` where row ``t`` is ``cache[block, :, t % BS, :]``
flattened. Those rows are *not* token ``t``'s K|V: a token's K and V are scattered over
its block's region. :class:`CpuEngineKV` converts the raw rows to the SDK's documented
per-token ``[2, L, T, NH * HS]`` (plane 0 = K, plane 1 = V) and back, exactly (a pure
element permutation, bit-exact round trip), with one strided copy when the kernel order
maps onto the rows (every power-of-two geometry) and two copies otherwise.

Kernels whose order was not verified against the installed vLLM (``neon``, ``vxe``,
``vsx``, ``rvv``, fp8 KV caches, anything unknown) are refused with
:class:`UnsupportedEngineLayoutError`, never guessed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError
from lmcache_kv_fast.layout.kvlayout import KVLayout, normalize_dtype

__all__ = [
    "UNVERIFIED_KERNELS",
    "VERIFIED_KERNELS",
    "CpuEngineKV",
    "UnsupportedEngineLayoutError",
    "raw_rows_from_paged_blocks",
    "select_cpu_kernel",
]

#: Kernels whose in-block order is implemented and was checked against vLLM 0.32.0's own
#: ``cpu_attn_reshape_and_cache`` on this machine (tests/engine/test_kernel_layouts.py).
VERIFIED_KERNELS: tuple[str, ...] = ("vec", "vec16", "amx")
#: Kernels vLLM 0.32.0 can choose elsewhere whose order is not verified (refused).
UNVERIFIED_KERNELS: tuple[str, ...] = ("neon", "vxe", "vsx", "rvv")
_AMX_DTYPES = (torch.bfloat16,)


class UnsupportedEngineLayoutError(KVCacheSDKError):
    """The engine's in-block KV order is unknown or unverified, so it is not converted."""


@dataclass(frozen=True)
class _Digit:
    """One mixed-radix digit of a token (``t``) or head-dim (``d``) index in a region."""

    axis: str
    size: int
    fstride: int


def select_cpu_kernel(dtype: torch.dtype | str, block_size: int, head_dim: int, *,
                      amx: bool | None = None, kv_cache_dtype: str = "auto") -> str:
    """The attention kernel vLLM 0.32.0 picks on x86 (``cpu_attn.py: _get_attn_isa``).

    Args:
        dtype: The model's (and KV cache's) dtype.
        block_size: vLLM block size.
        head_dim: Head size.
        amx: Whether the engine's CPU has AMX tiles; None asks this machine
            (``torch.cpu._is_amx_tile_supported()``), right when the engine runs here.
        kv_cache_dtype: vLLM's ``--kv-cache-dtype``; only ``"auto"`` is supported.

    Returns:
        ``"vec16"`` (head size a multiple of 16 but not 32, or block size not a multiple
        of 32), ``"amx"`` (AMX, bfloat16, block size a multiple of 32), else ``"vec"``.

    Raises:
        UnsupportedEngineLayoutError: An fp8 KV cache (its layout is not verified).
    """
    if kv_cache_dtype not in ("auto", "", None):
        raise UnsupportedEngineLayoutError(
            f"kv_cache_dtype {kv_cache_dtype!r}: only the unquantized cache ('auto') of a CPU "
            "engine is supported (fp8 KV layouts are not verified)"
        )
    dtype = normalize_dtype(dtype)
    if head_dim % 32 != 0 and head_dim % 16 == 0:
        return "vec16"
    if amx is None:
        amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if amx and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


def _plane_digits(kernel: str, bs: int, hs: int) -> tuple[list[_Digit], list[_Digit]]:
    """Region order of K and V: digits (major to minor per axis) with region strides."""
    t, d = "t", "d"
    if kernel in ("vec", "vec16"):  # K [HS, BS] column-major per token, V [BS, HS]
        return ([_Digit(d, hs, bs), _Digit(t, bs, 1)],
                [_Digit(t, bs, hs), _Digit(d, hs, 1)])
    if kernel == "amx":  # K [BS/16, HS/2, 16, 2]; V [HS/16, BS/2, 16, 2]
        return ([_Digit(t, bs // 16, 16 * hs), _Digit(d, hs // 2, 32), _Digit(t, 16, 2),
                 _Digit(d, 2, 1)],
                [_Digit(d, hs // 16, 16 * bs), _Digit(t, bs // 2, 32), _Digit(d, 16, 2),
                 _Digit(t, 2, 1)])
    raise UnsupportedEngineLayoutError(_kernel_error(kernel))  # pragma: no cover


def _kernel_error(kernel: Any) -> str:
    if kernel in UNVERIFIED_KERNELS:
        return (f"CPU attention kernel {kernel!r}: its in-block KV order is not verified "
                f"(verified: {', '.join(VERIFIED_KERNELS)}); refusing to guess. Use the raw "
                "rows (bit-exact copies only)")
    return (f"CPU attention kernel {kernel!r} is unknown; expected one of "
            f"{', '.join(VERIFIED_KERNELS)} (unverified, refused: {', '.join(UNVERIFIED_KERNELS)})")


def _split_for_rows(digits: list[_Digit], row: int) -> list[_Digit] | None:
    """Split digits so each lies within a row (< ``row``) or steps whole rows; else None."""
    out: list[_Digit] = []
    for dg in digits:
        if dg.fstride % row == 0 or dg.fstride * (dg.size - 1) < row:
            out.append(dg)
            continue
        if row % dg.fstride or dg.size % (row // dg.fstride):
            return None
        q = row // dg.fstride
        out += [_Digit(dg.axis, dg.size // q, row), _Digit(dg.axis, q, dg.fstride)]
    if sum(dg.fstride * (dg.size - 1) for dg in out if dg.fstride % row) >= row:
        return None
    return out


@dataclass(frozen=True)
class CpuEngineKV:
    """KV geometry of a CPU vLLM engine and the converter for its raw rows.

    Args:
        num_layers: Layers ``L``.
        num_kv_heads: KV heads ``NH`` (the whole model; CPU engines run world size 1).
        head_dim: Head size ``HS``.
        dtype: KV dtype.
        block_size: vLLM block size ``BS``.
        kernel: The engine's attention kernel (see :func:`select_cpu_kernel`).

    Raises:
        UnsupportedEngineLayoutError: Unknown/unverified kernel, or a geometry the kernel
            cannot have (AMX with non-bf16 or sizes not multiples of 16/32).
        InvalidArgumentError / InvalidTypeError: Bad counts or dtype.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    kernel: str

    def __post_init__(self) -> None:
        tok = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                       self.block_size)  # validates counts and dtype
        object.__setattr__(self, "dtype", tok.dtype)
        if self.kernel not in VERIFIED_KERNELS:
            raise UnsupportedEngineLayoutError(_kernel_error(self.kernel))
        if self.kernel == "amx" and (self.dtype not in _AMX_DTYPES or self.block_size % 32
                                     or self.head_dim % 32):
            raise UnsupportedEngineLayoutError(
                f"the amx kernel runs bfloat16 with block_size and head_dim multiples of 32; "
                f"got {tok.dtype_str}, block_size {self.block_size}, head_dim {self.head_dim}"
            )

    # ------------------------------------------------------------------ layouts
    @property
    def token_layout(self) -> KVLayout:
        """Two-plane per-token layout ``[2, L, T, NH * HS]`` (what users edit)."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                        self.block_size)

    @property
    def raw_layout(self) -> KVLayout:
        """Single-plane layout of the server's objects ``[L, T, NH * 2 * HS]`` (connect with it)."""
        return KVLayout(self.num_layers, 1, self.num_kv_heads * 2 * self.head_dim, self.dtype,
                        self.block_size, mla=True)

    @classmethod
    def from_token_layout(cls, layout: KVLayout, kernel: str) -> CpuEngineKV:
        """From a two-plane (e.g. :meth:`KVLayout.from_hf_config`) layout and a kernel."""
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        if layout.mla:
            raise UnsupportedEngineLayoutError(
                "an MLA model's CPU cache is not the fused K/V format this converter handles"
            )
        return cls(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                   layout.block_size, kernel)

    def describe(self) -> str:
        """One line: geometry and kernel."""
        return (f"CPU engine KV: {self.num_layers} layers, {self.num_kv_heads} KV heads x "
                f"{self.head_dim}, {self.token_layout.dtype_str}, block_size {self.block_size}, "
                f"kernel {self.kernel}")

    # ------------------------------------------------------------------ convert
    def to_tokens(self, raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Raw rows ``[L, T, NH*2*HS]`` -> per-token K/V ``[2, L, T, NH*HS]``.

        Args:
            raw: The rows as the server holds them (e.g. ``retrieve`` with
                :attr:`raw_layout`); ``T`` a multiple of ``block_size``. A
                non-contiguous tensor is copied first.
            out: Optional destination of the result's shape and dtype: contiguous, or a
                slice of a contiguous tensor along the token dimension (e.g.
                ``kv.narrow(2, start, T)``: its last dimension contiguous, the others
                non-overlapping).

        Returns:
            ``out`` or a new tensor.

        Raises:
            InvalidArgumentError / InvalidTypeError: Wrong shape, dtype or ``T``.
        """
        tokens = self._check(raw, "raw", raw=True)
        res = self._out(out, (2, self.num_layers, tokens, self.num_kv_heads * self.head_dim),
                        token_view=True)
        self._move(raw.contiguous(), res, tokens, to_raw=False)
        return res

    def to_raw(self, kv: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token K/V ``[2, L, T, NH*HS]`` -> the engine's raw rows ``[L, T, NH*2*HS]``.

        The exact inverse of :meth:`to_tokens` (store the result with :attr:`raw_layout`).
        ``kv`` may be a token slice of a contiguous tensor (read in place); any other
        non-contiguous ``kv`` is copied first. ``out``: optional contiguous destination.

        Raises:
            InvalidArgumentError / InvalidTypeError: Wrong shape, dtype or ``T``.
        """
        tokens = self._check(kv, "kv", raw=False)
        res = self._out(out, (self.num_layers, tokens, self.num_kv_heads * 2 * self.head_dim))
        self._move(res, kv if _token_view_ok(kv) else kv.contiguous(), tokens, to_raw=True)
        return res

    def block_offsets(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a token's K/V elements lie in the raw rows, as two additive tables.

        Element ``(plane p, layer l, token t, head h, dim d)`` of raw rows ``[L, T, W]``
        (``W = NH*2*HS``) is at element ``l*T*W + (t//BS)*BS*W + h*2*HS + tok_off[p][t %
        BS] + dim_off[p][d]``: what ``copy.native_backend.fused_blocks`` moves tokens by.
        The form holds when :meth:`to_raw` takes its single-copy path (each digit either
        inside a row or stepping whole rows, and ``BS*HS`` whole rows per plane).

        Returns:
            int64 ``(tok_off [2, BS], dim_off [2, HS])``, or None when it does not hold.
        """
        tables = _block_offsets(self.kernel, self.block_size, self.head_dim, self.num_kv_heads)
        return None if tables is None else (tables[0].clone(), tables[1].clone())

    def block_offset_lists(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """:meth:`block_offsets` flattened (``tok_off``, ``dim_off``), immutable and shared.

        Cached per geometry: what the fused kernels are handed on every call, without a
        copy of the tables each time.
        """
        return _block_offset_lists(self.kernel, self.block_size, self.head_dim,
                                   self.num_kv_heads)

    def _check(self, t: Any, name: str, *, raw: bool) -> int:
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        nh, hs, lay = self.num_kv_heads, self.head_dim, self.num_layers
        want = "[L, T, NH*2*HS]" if raw else "[2, L, T, NH*HS]"
        ok = (t.dim() == 3 and t.shape[0] == lay and t.shape[2] == nh * 2 * hs) if raw else (
            t.dim() == 4 and t.shape[0] == 2 and t.shape[1] == lay and t.shape[3] == nh * hs)
        if not ok:
            dims = (lay, "T", nh * 2 * hs) if raw else (2, lay, "T", nh * hs)
            raise InvalidArgumentError(
                f"{name}: expected shape {want} = {list(dims)}, got {list(t.shape)}"
            )
        if t.dtype != self.dtype:
            raise InvalidArgumentError(f"{name}: expected dtype {self.dtype}, got {t.dtype}")
        tokens = t.shape[1] if raw else t.shape[2]
        if tokens % self.block_size:
            raise InvalidArgumentError(
                f"{name}: T must be a multiple of the engine block size {self.block_size} "
                f"(whole blocks), got {tokens}"
            )
        return int(tokens)

    def _out(self, out: Any, shape: tuple[int, ...], *, token_view: bool = False
             ) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=self.dtype)
        if not isinstance(out, torch.Tensor):
            raise InvalidTypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        layout_ok = _token_view_ok(out) if token_view else out.is_contiguous()
        if tuple(out.shape) != shape or out.dtype != self.dtype or not layout_ok or \
                out.device.type != "cpu":
            what = "contiguous (or token-sliced)" if token_view else "contiguous"
            raise InvalidArgumentError(
                f"out: expected a {what} CPU {list(shape)} {self.dtype} tensor, got "
                f"{list(out.shape)} {out.dtype} on {out.device} (strides {list(out.stride())})"
            )
        return out

    def _move(self, raw: torch.Tensor, kv: torch.Tensor, tokens: int, *, to_raw: bool) -> None:
        """Copy between contiguous ``raw`` and ``kv`` (direction ``to_raw``)."""
        nb = tokens // self.block_size
        row = 2 * self.head_dim
        planes = _plane_digits(self.kernel, self.block_size, self.head_dim)
        split = [_split_for_rows(ds, row) for ds in planes]
        base_ok = (self.block_size * self.head_dim) % row == 0
        if all(s is not None for s in split) and base_ok:
            for plane, digits in enumerate(split):
                assert digits is not None
                src = self._raw_view(raw, digits, plane, nb, region_rows=True)
                self._pair(src, self._kv_view(kv, digits, plane, nb), to_raw)
            return
        # Two copies: gather each (block, head) region contiguously first.
        lay, nh, bs = self.num_layers, self.num_kv_heads, self.block_size
        regions = raw.view(lay, nb, bs, nh, row).permute(0, 1, 3, 2, 4)
        tmp = torch.empty((lay, nb, nh, bs, row), dtype=self.dtype)
        if not to_raw:
            tmp.copy_(regions)
        for plane, digits in enumerate(planes):
            src = self._raw_view(tmp, digits, plane, nb, region_rows=False)
            self._pair(src, self._kv_view(kv, digits, plane, nb), to_raw)
        if to_raw:
            regions.copy_(tmp)

    @staticmethod
    def _pair(raw_view: torch.Tensor, kv_view: torch.Tensor, to_raw: bool) -> None:
        # the native tiled permutation copy (copy/strided.py), torch's copy_ without it
        from lmcache_kv_fast.copy.strided import copy_view

        if to_raw:
            copy_view(raw_view, kv_view)
        else:
            copy_view(kv_view, raw_view)

    def _order(self, digits: list[_Digit]) -> tuple[list[_Digit], list[_Digit]]:
        return [g for g in digits if g.axis == "t"], [g for g in digits if g.axis == "d"]

    def _raw_view(self, buf: torch.Tensor, digits: list[_Digit], plane: int, nb: int, *,
                  region_rows: bool) -> torch.Tensor:
        """View of one plane of the raw rows (``region_rows``) or of region-contiguous data."""
        lay, nh, bs, hs = self.num_layers, self.num_kv_heads, self.block_size, self.head_dim
        row, width = 2 * hs, nh * 2 * hs
        base = plane * bs * hs
        t_dig, d_dig = self._order(digits)

        def stride(g: _Digit) -> int:
            if not region_rows:
                return g.fstride
            return (g.fstride // row) * width if g.fstride % row == 0 else g.fstride

        if region_rows:
            outer, head, offset = [nb * bs * width, bs * width], row, (base // row) * width
        else:
            outer, head, offset = [nb * nh * bs * row, nh * bs * row], bs * row, base
        sizes = [lay, nb, *(g.size for g in t_dig), nh, *(g.size for g in d_dig)]
        strides = [*outer, *(stride(g) for g in t_dig), head, *(stride(g) for g in d_dig)]
        return buf.as_strided(sizes, strides, buf.storage_offset() + offset)

    def _kv_view(self, kv: torch.Tensor, digits: list[_Digit], plane: int,
                 nb: int) -> torch.Tensor:
        """View of ``kv[plane]`` as ``[L, NB, *t digits, NH, *d digits]``.

        ``kv`` is ``[2, L, T, NH*HS]`` with a contiguous last dimension (any plane, layer
        and token strides: a token slice of a larger tensor works in place).
        """
        lay, nh, bs, hs = self.num_layers, self.num_kv_heads, self.block_size, self.head_dim
        t_dig, d_dig = self._order(digits)
        s_plane, s_layer, s_tok = kv.stride(0), kv.stride(1), kv.stride(2)

        def weights(ds: list[_Digit], unit: int) -> list[int]:
            out, acc = [], unit
            for g in reversed(ds):
                out.append(acc)
                acc *= g.size
            return out[::-1]

        sizes = [lay, nb, *(g.size for g in t_dig), nh, *(g.size for g in d_dig)]
        strides = [s_layer, bs * s_tok, *weights(t_dig, s_tok), hs, *weights(d_dig, 1)]
        assert math.prod(g.size for g in t_dig) == bs and math.prod(g.size for g in d_dig) == hs
        return kv.as_strided(sizes, strides, kv.storage_offset() + plane * s_plane)


@functools.lru_cache(maxsize=64)
def _block_offsets(kernel: str, bs: int, hs: int, nh: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:meth:`CpuEngineKV.block_offsets` of one geometry (cached: a rewrite asks per call)."""
    row, width = 2 * hs, nh * 2 * hs
    if (bs * hs) % row:
        return None
    tok = torch.zeros((2, bs), dtype=torch.int64)
    dim = torch.zeros((2, hs), dtype=torch.int64)
    for plane, digits in enumerate(_plane_digits(kernel, bs, hs)):
        split = _split_for_rows(digits, row)
        if split is None:
            return None
        for axis, table in (("t", tok[plane]), ("d", dim[plane])):
            off = torch.zeros(1, dtype=torch.int64)
            for g in (g for g in split if g.axis == axis):  # major to minor
                step = (g.fstride // row) * width if g.fstride % row == 0 else g.fstride
                off = (off[:, None] + torch.arange(g.size, dtype=torch.int64) * step).reshape(-1)
            table.copy_(off)
        tok[plane] += plane * (bs * hs // row) * width  # V after K's whole rows
    return tok, dim


@functools.lru_cache(maxsize=64)
def _block_offset_lists(kernel: str, bs: int, hs: int, nh: int
                        ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    tables = _block_offsets(kernel, bs, hs, nh)
    if tables is None:
        return None
    return tuple(tables[0].reshape(-1).tolist()), tuple(tables[1].reshape(-1).tolist())


def _token_view_ok(t: torch.Tensor) -> bool:
    """Whether a ``[2, L, T, D]`` tensor can be addressed in place by :meth:`CpuEngineKV._kv_view`.

    Contiguous last dimension, and plane / layer / token strides that do not overlap (a
    contiguous tensor, or one narrowed along its token dimension).
    """
    if t.dim() != 4 or t.stride(3) != 1:
        return False
    _p, lay, tokens, width = t.shape
    return (t.stride(2) >= width and t.stride(1) >= max(1, tokens) * t.stride(2)
            and t.stride(0) >= max(1, lay) * t.stride(1))


def raw_rows_from_paged_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The rows LMCache gathers from a CPU engine's paged blocks.

    Args:
        blocks: ``[L, nb, NH, BS, 2*HS]`` (the engine's per-layer caches indexed by a
            request's block ids, stacked over layers).

    Returns:
        ``[L, nb*BS, NH*2*HS]``: row ``t`` is ``cache[block t//BS, :, t % BS, :]`` flattened.
    """
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 5:
        raise InvalidArgumentError(
            f"blocks: expected a [L, nb, NH, BS, 2*HS] tensor, got "
            f"{getattr(blocks, 'shape', type(blocks).__name__)}"
        )
    lay, nb, nh, bs, row = blocks.shape
    return blocks.permute(0, 1, 3, 2, 4).reshape(lay, nb * bs, nh * row)
