"""The 19 ``EngineKVFormat`` values of LMCache 0.5.6 as one table (docs/protocol.md §6.1).

An engine KV format names the shape of the paged KV cache that a serving engine
registered with the server. The enum *name is the shape*: ``_X_`` separates list
levels and the last segment is the innermost tensor, so ``TWO_X_NL_X_NBBS_NH_HS``
reads ``2 x NL x [PBS, NH, HS]``. The server's ``/status`` reports, per kernel group,
the name (``engine_kv_format``), the symbolic shape (``engine_kv_shape``) and the
shape with numbers substituted (``engine_kv_concrete_shape``).

:data:`FORMATS` holds every fact about a format exactly once. Facts that the name
already encodes (list levels, innermost dimensions and so where NL / NH / BS / the
head size sit) are *derived* from the name, not repeated; the other facts (K/V plane
count, MLA, packed K|V, whether ``/status`` can print a concrete shape, ...) are
columns of the table. The decoder (:mod:`lmcache_kv_fast.layout.decode`) only reads
this table; it never lists formats itself.

Symbols: NB blocks, NL layers (list entries), BS tokens per block, NH KV heads,
HS head size, PBS = NB·BS fused, CS = packed K|V content (2·HS), NP planes of a
per-layer tuple. ``2`` / ``1`` are literal axes.

This module is pure Python (no torch) and never imports ``lmcache``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from lmcache_kv_fast.errors import KVCacheSDKError

__all__ = [
    "FORMATS",
    "EngineKVFormat",
    "FormatSpec",
    "get_format",
]

#: Enum-name token -> symbolic label, as the server renders ``engine_kv_shape``.
_TOKEN_LABELS: Mapping[str, str] = {
    "ONE": "1",
    "TWO": "2",
    "NP": "NP",
    "NBBS": "PBS",
    "NB": "NB",
    "NL": "NL",
    "BS": "BS",
    "NH": "NH",
    "HS": "HS",
    "CS": "CS",
    # DSA indexer blocked-scale regions; each is sized by tokens per block.
    "BSV": "BSxVALS",
    "BSS": "BSxSCALES",
}

#: Labels that stay literal in a concrete shape (never replaced by a number).
LITERAL_LABELS: frozenset[str] = frozenset({"1", "2", "NP"})

#: Labels the block size can be read from (the BS axis, or the DSA value region).
_BLOCK_LABELS = ("BS", "BSxVALS")

#: Labels holding the per-head content size (plain or packed K|V).
_HEAD_LABELS = ("HS", "CS")


@dataclass(frozen=True)
class FormatSpec:
    """Static facts of one engine KV format.

    The first ten fields are the table columns; the last eight are derived from ``name``
    in ``__post_init__``, never passed in (a position is ``None`` where the axis is absent).

    Attributes:
        value: Enum value (0..18), as in ``lmcache_native.EngineKVFormat``.
        name: Enum name, exactly as ``/status`` prints ``engine_kv_format``.
        kv_size: Planes of the server's chunk object: 2 (separate K and V) or 1
            (MLA latent, packed K|V or independent components).
        is_mla: Multi-head latent attention (one latent "head"); exactly ``/status``'s ``is_mla``.
        fused_kv: K and V packed in the trailing content axis: the object's head size is
            the packed width (2·HS or CS).
        status_shape_known: ``False`` when 0.5.6 prints ``"Unknown (...)"`` (it has no size
            for CS / BSxVALS / BSxSCALES); D must then come from ``cache_size_per_token``.
        kv_tuple: Each list entry is a tuple ((K, V) or NP MLA planes), not one tensor.
        single_kv: Each list entry is one K *or* V tensor: NL counts tensors, not layers.
        deprecated: Detection no longer produces this format.
        backend: Representative engine / attention backend (diagnostic only).
        list_levels: Symbolic list levels, outermost first (``("2", "NL")``); empty if cross-layer.
        inner_dims: Symbolic dims of the innermost tensor.
        nl_level: Position of ``NL`` in ``list_levels``.
        nl_index: Position of ``NL`` in ``inner_dims`` (cross-layer formats).
        nh_index: Position of ``NH`` in ``inner_dims``; ``None`` for MLA (NH is the constant 1).
        bs_index: Position of the block-size axis; ``None`` with a fused PBS axis (BS then
            comes from ``tokens_per_block``).
        head_index: Position of the head-size axis (HS or CS); ``None`` for the DSA indexer
            (the width is not in the shape).
        pbs_index: Position of the fused PBS axis.
    """

    value: int
    name: str
    kv_size: int
    is_mla: bool = False
    fused_kv: bool = False
    status_shape_known: bool = True
    kv_tuple: bool = False
    single_kv: bool = False
    deprecated: bool = False
    backend: str = ""

    list_levels: tuple[str, ...] = field(init=False, repr=False)
    inner_dims: tuple[str, ...] = field(init=False, repr=False)
    nl_level: int | None = field(init=False, repr=False)
    nl_index: int | None = field(init=False, repr=False)
    nh_index: int | None = field(init=False, repr=False)
    bs_index: int | None = field(init=False, repr=False)
    head_index: int | None = field(init=False, repr=False)
    pbs_index: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        *levels, inner = self.name.split("_X_")
        list_levels = tuple(_TOKEN_LABELS[t] for t in levels)
        inner_dims = tuple(_TOKEN_LABELS[t] for t in inner.split("_"))

        def first(where: tuple[str, ...], labels: tuple[str, ...]) -> int | None:
            for i, label in enumerate(where):
                if label in labels:
                    return i
            return None

        derived = {
            "list_levels": list_levels,
            "inner_dims": inner_dims,
            "nl_level": first(list_levels, ("NL",)),
            "nl_index": first(inner_dims, ("NL",)),
            "nh_index": first(inner_dims, ("NH",)),
            "bs_index": first(inner_dims, _BLOCK_LABELS),
            "head_index": first(inner_dims, _HEAD_LABELS),
            "pbs_index": first(inner_dims, ("PBS",)),
        }
        for key, val in derived.items():
            object.__setattr__(self, key, val)

    # ------------------------------------------------------------------ derived facts
    @property
    def is_cross_layer(self) -> bool:
        """One tensor holds every layer (no ``NL x`` list level)."""
        return not self.list_levels

    @property
    def symbolic_shape(self) -> str:
        """Symbolic shape as ``/status`` prints ``engine_kv_shape``.

        Example: ``"NL x [2, NB, BS, NH, HS]"``.
        """
        body = ", ".join(self.inner_dims)
        return " x ".join([*self.list_levels, f"[{body}]"])

    @property
    def head_size_multipliers(self) -> tuple[int, ...]:
        """Factors from the printed head-size axis to the object's head size.

        For ``..._TWO_HS`` fused formats (10, 11) the printed value is ambiguous:
        0.5.6's ``/status`` prints the *packed* head size (2·HS) in the HS
        position (factor 1), while the raw per-layer tensor shape carries the
        per-half HS (factor 2). The first factor
        is what 0.5.6's ``/status`` produces; a decoder may use
        ``cache_size_per_token`` to choose.
        """
        if self.fused_kv and "2" in self.inner_dims and self.head_index is not None:
            return (1, 2)
        return (1,)

    def concrete_shape(self, sizes: Mapping[str, int]) -> str:
        """Render the shape with numbers, the way the server renders it.

        Literal axes (``2``, ``1``, ``NP``) stay as they are.

        Args:
            sizes: Number for every non-literal label used by this format (e.g.
                ``{"NL": 4, "NB": 64, "BS": 16, "NH": 8, "HS": 128}``; ``PBS``,
                ``CS``, ``BSxVALS``, ``BSxSCALES`` as needed).

        Returns:
            For example ``"4 x [2, 64, 16, 8, 128]"``.

        Raises:
            KeyError: A label this format needs is missing from ``sizes``.

        """

        def token(label: str) -> str:
            return label if label in LITERAL_LABELS else str(sizes[label])

        body = ", ".join(token(d) for d in self.inner_dims)
        return " x ".join([*(token(level) for level in self.list_levels), f"[{body}]"])


#: Every engine KV format of LMCache 0.5.6, indexed by enum value.
FORMATS: tuple[FormatSpec, ...] = (
    FormatSpec(0, "NB_NL_TWO_BS_NH_HS", 2, backend="vLLM CROSS_LAYER"),
    FormatSpec(1, "NL_X_TWO_NB_BS_NH_HS", 2, backend="vLLM non-MLA flash attention"),
    FormatSpec(2, "NL_X_NB_TWO_BS_NH_HS", 2, backend="vLLM FlashInfer"),
    FormatSpec(3, "NL_X_NB_BS_HS", 1, is_mla=True, backend="vLLM / SGLang MLA"),
    FormatSpec(4, "TWO_X_NL_X_NBBS_NH_HS", 2, backend="SGLang MHA"),
    FormatSpec(5, "NL_X_NBBS_ONE_HS", 1, is_mla=True, backend="SGLang MLA"),
    FormatSpec(6, "NL_X_TWO_NB_NH_BS_HS", 2, backend="vLLM flash attention (HND)"),
    FormatSpec(7, "NL_X_NB_TWO_NH_BS_HS", 2, backend="FlashInfer (HND)"),
    FormatSpec(8, "NB_NL_TWO_NH_BS_HS", 2, backend="TensorRT-LLM (cross-layer HND)"),
    FormatSpec(9, "TWO_X_NL_X_NB_BS_NH_HS", 2, backend="SGLang MHA (4-D pages)"),
    FormatSpec(
        10, "NL_X_NB_NH_BS_TWO_HS", 1, fused_kv=True, deprecated=True,
        backend="vLLM blocks-first, fused K/V (HND)",
    ),
    FormatSpec(
        11, "NL_X_NB_BS_NH_TWO_HS", 1, fused_kv=True, deprecated=True,
        backend="vLLM blocks-first, fused K/V (NHD)",
    ),
    FormatSpec(
        12, "NL_X_NB_NH_BS_CS", 1, fused_kv=True, status_shape_known=False,
        backend="vLLM blocks-first, fused K/V (HND)",
    ),
    FormatSpec(
        13, "NL_X_NB_BS_NH_CS", 1, fused_kv=True, status_shape_known=False,
        backend="vLLM blocks-first, fused K/V (NHD)",
    ),
    FormatSpec(
        14, "NL_X_NB_BSV_BSS", 1, is_mla=True, status_shape_known=False,
        backend="vLLM DSA indexer (fp8 values + scales)",
    ),
    FormatSpec(15, "NL_X_TWO_NB_NH_ONE_BS_HS", 2, backend="vLLM-RBLN (HND)"),
    FormatSpec(
        16, "NL_X_TWO_X_NB_BS_NH_HS", 2, kv_tuple=True,
        backend="vLLM-Ascend per-layer (K, V) tuples",
    ),
    FormatSpec(
        17, "NL_X_NP_X_NB_BS_ONE_HS", 1, is_mla=True, kv_tuple=True,
        backend="vLLM-Ascend MLA / DSA plane tuples",
    ),
    FormatSpec(
        18, "NL_X_NB_BS_NH_HS", 1, single_kv=True,
        backend="SGLang independent K / V components",
    ),
)

_BY_NAME: Mapping[str, FormatSpec] = {spec.name: spec for spec in FORMATS}

#: The enum, built from the table (same names and values as lmcache's).
EngineKVFormat = enum.IntEnum(  # type: ignore[misc]
    "EngineKVFormat", [(spec.name, spec.value) for spec in FORMATS]
)
EngineKVFormat.__doc__ = "Engine KV-cache memory layouts (mirrors lmcache_native.EngineKVFormat)."


def get_format(fmt: str | int | enum.Enum) -> FormatSpec:
    """Look a format up by enum name, enum member or value.

    Args:
        fmt: ``"NL_X_TWO_NB_BS_NH_HS"``, ``"EngineKVFormat.NL_X_TWO_NB_BS_NH_HS"``,
            ``1``, or an enum member with that name (this module's
            :data:`EngineKVFormat` or lmcache's).

    Returns:
        The format's :class:`FormatSpec`.

    Raises:
        KVCacheSDKError: Unknown name or value (for instance a format added by a
            newer server); the message lists the known names.

    """
    if not isinstance(fmt, str | int) and isinstance(getattr(fmt, "name", None), str):
        fmt = fmt.name  # an enum member (ours, or lmcache's pybind11 one)
    if isinstance(fmt, str):
        spec = _BY_NAME.get(fmt.removeprefix("EngineKVFormat."))
    elif isinstance(fmt, int) and not isinstance(fmt, bool) and 0 <= fmt < len(FORMATS):
        spec = FORMATS[fmt]
    else:
        spec = None
    if spec is None:
        raise KVCacheSDKError(
            f"unknown engine KV format {fmt!r}: this SDK knows the {len(FORMATS)} formats "
            f"of LMCache 0.5.6 ({', '.join(_BY_NAME)}); a newer server may use a format "
            "this SDK cannot decode"
        )
    return spec
