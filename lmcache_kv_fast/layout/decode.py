"""Decode the server's ``/status`` ``cache_context_meta`` entries (docs/protocol.md §5.2, §6).

A vLLM (lmcache-driven) registration shows up in ``GET /status`` as one entry per
rank under ``cache_context_meta``::

    {"model_name": "m", "world_size": 1,
     "kv_cache_layout": {"num_layers": 4, "num_blocks": 64, "cache_size_per_token": 16384,
       "kernel_groups": [{"kernel_group_idx": 0, "engine_group_idx": 0, "object_group_idx": 0,
         "num_layers": 4, "layer_indices": [0, 1, 2, 3], "tokens_per_block": 16,
         "slots_per_block": 16, "dtype": "torch.bfloat16",
         "engine_kv_concrete_shape": "4 x [2, 64, 16, 8, 128]", "is_mla": false,
         "engine_kv_format": "NL_X_TWO_NB_BS_NH_HS", ...}]}}

:func:`decode_status_entry` turns it into a :class:`DecodedEntry`: one
:class:`DecodedGroup` per kernel group and, for a single-group model, the
:class:`ChunkObject` the SDK registers and moves (docs/protocol.md §6.3). Everything the server
sent is validated; anything missing, ill-typed or inconsistent raises
:class:`~lmcache_kv_fast.errors.KVCacheSDKError` naming the field and what came.
Hybrid (multi-group) entries decode without error; :meth:`DecodedEntry.require_single_group`
refuses them with a per-group explanation (docs/protocol.md §8.6).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.formats import LITERAL_LABELS, FormatSpec, get_format

__all__ = [
    "ChunkObject",
    "DecodedEntry",
    "DecodedGroup",
    "decode_kernel_group",
    "decode_status_entry",
    "find_model_entries",
    "format_layer_indices",
    "kernel_groups_of",
    "parse_concrete_shape",
]

logger = logging.getLogger(__name__)

_UNKNOWN_PREFIX = "Unknown ("
_LEVEL_RE = re.compile(r"^(?:\d+|[A-Za-z_]\w*)$")


# ---------------------------------------------------------------------- field access
def _describe(value: Any) -> str:
    """``repr`` of a received value plus its type, truncated for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _get(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in mapping:
        raise KVCacheSDKError(
            f"{where}.{key}: missing (got keys {sorted(mapping)}); the server's /status "
            "does not look like LMCache 0.5.x"
        )
    return mapping[key]


def _int(value: Any, name: str, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise KVCacheSDKError(f"{name}: expected an int >= {minimum}, got {_describe(value)}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise KVCacheSDKError(f"{name}: expected a non-empty str, got {_describe(value)}")
    return value


def _dict(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise KVCacheSDKError(f"{name}: expected an object, got {_describe(value)}")
    return value


def _int_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise KVCacheSDKError(f"{name}: expected a list of ints >= 0, got {_describe(value)}")
    return tuple(value)


def _dtype(value: Any, name: str) -> tuple[str, int]:
    """Validate a ``str(torch.dtype)``; return the bare name and the item size."""
    text = _str(value, name)
    bare = text.removeprefix("torch.")
    dtype = getattr(torch, bare, None)
    if not isinstance(dtype, torch.dtype):
        raise KVCacheSDKError(
            f"{name}: expected a torch dtype name like 'torch.bfloat16', got {_describe(value)}"
        )
    return str(dtype).removeprefix("torch."), dtype.itemsize


def format_layer_indices(indices: Sequence[int]) -> str:
    """Compact text for a layer-index list: ``[0, 1, 2, 3, 8]`` -> ``"0-3, 8"``.

    Args:
        indices: Layer indices (any order).

    Returns:
        Comma-separated runs, ``"none"`` for an empty list.

    """
    values = sorted(set(indices))
    if not values:
        return "none"
    runs: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(runs)


# ---------------------------------------------------------------------- concrete shape
def parse_concrete_shape(text: str) -> tuple[tuple[int | str, ...], tuple[int, ...]]:
    """Parse an ``engine_kv_concrete_shape`` string (docs/protocol.md §6.2).

    The innermost tensor is the text inside the **last** ``[...]``; what precedes it
    are list levels joined by ``" x "``. Numeric levels become ints; symbolic ones
    (``NP``) stay strings.

    Args:
        text: For example ``"4 x [2, 64, 16, 8, 128]"``, ``"2 x 3 x [112, 4, 64]"``,
            ``"3 x NP x [7, 16, 1, 576]"`` or ``"[7, 3, 2, 16, 4, 64]"`` (cross-layer).

    Returns:
        ``(list_levels, inner_dims)``, e.g. ``((4,), (2, 64, 16, 8, 128))``.

    Raises:
        KVCacheSDKError: ``text`` is not a str, is an ``"Unknown (...)"`` placeholder,
            or is not of the form above.

    """
    if not isinstance(text, str):
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape: expected a str, got {_describe(text)}"
        )
    stripped = text.strip()
    if stripped.startswith(_UNKNOWN_PREFIX):
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape is {text!r}: the server prints no concrete shape "
            "for this format; the geometry must come from cache_size_per_token"
        )
    close = stripped.rfind("]")
    opening = stripped.rfind("[", 0, close) if close >= 0 else -1
    if opening < 0 or stripped[close + 1 :].strip():
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape {text!r}: expected '[d0, d1, ...]' optionally "
            "preceded by list levels joined with ' x '"
        )
    try:
        inner = tuple(int(part) for part in stripped[opening + 1 : close].split(","))
    except ValueError:
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape {text!r}: the innermost dims are not all integers"
        ) from None
    if any(d < 0 for d in inner):
        raise KVCacheSDKError(f"engine_kv_concrete_shape {text!r}: negative dimension")

    prefix = stripped[:opening].strip()
    levels: list[int | str] = []
    if prefix:
        if not prefix.endswith("x"):
            raise KVCacheSDKError(
                f"engine_kv_concrete_shape {text!r}: list levels must be joined with ' x '"
            )
        for part in (p.strip() for p in prefix[:-1].split(" x ")):
            if not _LEVEL_RE.match(part):
                raise KVCacheSDKError(
                    f"engine_kv_concrete_shape {text!r}: bad list level {part!r}"
                )
            levels.append(int(part) if part.isdigit() else part)
    return tuple(levels), inner


# ---------------------------------------------------------------------- decoded values
@dataclass(frozen=True)
class DecodedGroup:
    """Geometry of one kernel group of a ``/status`` entry (per shard).

    Attributes:
        format_name: ``engine_kv_format``, e.g. ``"NL_X_TWO_NB_BS_NH_HS"``.
        format_value: The format's enum value (0..18).
        kernel_group_idx: Position of the group in ``kernel_groups``.
        engine_group_idx: Engine (paged-block address space) group it belongs to.
        object_group_idx: LMCache object group it is stored in.
        planes: Planes of the chunk object (``kv_size``): 2 (K, V) or 1.
        num_layers: Layers (list entries) of the group.
        layer_indices: Registered tensor indices of the group.
        num_heads: KV heads in this shard (1 for MLA); ``None`` when the status
            does not carry it (packed K|V formats with an ``Unknown`` shape).
        head_size: Per-head width the object uses (packed 2·HS for fused K|V,
            the summed plane width for MLA tuples); ``None`` when unknown.
        hidden_size: ``D = num_heads * head_size`` of one object plane per token;
            ``None`` only inside a hybrid entry when it cannot be derived.
        block_size: Logical tokens per engine block (``tokens_per_block``).
        slots_per_block: Physical slots per block (differs from ``block_size``
            for compressed groups).
        dtype: Dtype name without ``"torch."``, e.g. ``"bfloat16"``.
        itemsize: Bytes per element of ``dtype``.
        is_mla: Multi-head latent attention format.
        concrete_shape: The ``engine_kv_concrete_shape`` string as received.

    """

    format_name: str
    format_value: int
    kernel_group_idx: int
    engine_group_idx: int
    object_group_idx: int
    planes: int
    num_layers: int
    layer_indices: tuple[int, ...]
    num_heads: int | None
    head_size: int | None
    hidden_size: int | None
    block_size: int
    slots_per_block: int
    dtype: str
    itemsize: int
    is_mla: bool
    concrete_shape: str

    @property
    def kv_size(self) -> int:
        """Alias of :attr:`planes` (the server's name)."""
        return self.planes

    @property
    def compress_ratio(self) -> int:
        """Logical tokens per physical slot (1 for uncompressed groups)."""
        return max(1, self.block_size // self.slots_per_block)

    def describe(self) -> str:
        """One line naming the group's layers, format, block size and geometry."""
        d = "?" if self.hidden_size is None else str(self.hidden_size)
        slots = (
            "" if self.slots_per_block == self.block_size
            else f" (slots_per_block {self.slots_per_block})"
        )
        return (
            f"group {self.kernel_group_idx} (engine group {self.engine_group_idx}): "
            f"layers {format_layer_indices(self.layer_indices)} ({self.num_layers}), "
            f"format {self.format_name}, block_size {self.block_size}{slots}, "
            f"planes {self.planes}, D {d}, {self.dtype}"
        )


@dataclass(frozen=True)
class ChunkObject:
    """The server-side object of one chunk (one shard), as the SDK registers it (§6.3).

    The engine-driven object is ``[2, L, C, D]``, or ``[L, C, D]`` when it has one
    plane (``use_mla``).

    Attributes:
        planes: 2 (K and V) or 1.
        num_layers: ``L``.
        hidden_size: ``D`` of one plane per token, for one shard.
        dtype: Dtype name without ``"torch."``.
        itemsize: Bytes per element.
        block_size: Tokens per block (``BS``).
        chunk_size: Tokens per chunk (``C``).
        num_physical_slots: ``(C // BS) · BS`` (= ``C``).

    """

    planes: int
    num_layers: int
    hidden_size: int
    dtype: str
    itemsize: int
    block_size: int
    chunk_size: int
    num_physical_slots: int

    @property
    def use_mla(self) -> bool:
        """One-plane object, registered with ``use_mla=True``."""
        return self.planes == 1

    @property
    def shape(self) -> tuple[int, ...]:
        """Engine-driven object shape: ``(2, L, C, D)`` or ``(L, C, D)``."""
        if self.planes == 1:
            return (self.num_layers, self.num_physical_slots, self.hidden_size)
        return (self.planes, self.num_layers, self.num_physical_slots, self.hidden_size)

    @property
    def nbytes(self) -> int:
        """Bytes of one chunk object."""
        return (
            self.planes * self.num_layers * self.num_physical_slots * self.hidden_size
            * self.itemsize
        )


@dataclass(frozen=True)
class DecodedEntry:
    """One decoded ``cache_context_meta`` entry (one rank of one model).

    Attributes:
        model_name: The registered model name.
        world_size: KV world size (tensor-parallel shards) of the registration.
        chunk_size: Tokens per chunk the chunk object was derived for.
        num_layers: ``kv_cache_layout.num_layers`` (registered tensors, all groups).
        num_blocks: ``kv_cache_layout.num_blocks`` (``None`` if absent).
        cache_size_per_token: Bytes per logical token, summed over the groups.
        groups: One :class:`DecodedGroup` per kernel group, in order.
        chunk: The chunk object for a single-group entry; ``None`` for hybrids.

    """

    model_name: str
    world_size: int
    chunk_size: int
    num_layers: int
    num_blocks: int | None
    cache_size_per_token: int
    groups: tuple[DecodedGroup, ...]
    chunk: ChunkObject | None

    @property
    def is_hybrid(self) -> bool:
        """More than one kernel group (hybrid / multi-group model)."""
        return len(self.groups) != 1

    def require_single_group(self) -> ChunkObject:
        """Return the chunk object, refusing hybrid entries.

        Returns:
            The single group's :class:`ChunkObject`.

        Raises:
            KVCacheSDKError: The entry has several kernel groups; the message names
                each group's layers, format and block size and explains why the
                engine-driven path cannot serve it (docs/protocol.md §8.6).

        """
        if self.chunk is not None:
            return self.chunk
        lines = "; ".join(g.describe() for g in self.groups)
        raise KVCacheSDKError(
            f"model {self.model_name!r} has a hybrid KV layout with {len(self.groups)} "
            f"kernel groups: {lines}. The server's engine-driven path, which this SDK "
            "uses, handles exactly one group (one [planes, L, C, D] object shape, object "
            "group 0), and registering one for this model would replace vLLM's "
            "multi-group layout on the server until vLLM re-registers (docs/protocol.md "
            "§8.6). Only single-group models are supported"
        )


# ---------------------------------------------------------------------- decoding
def _match_template(
    spec: FormatSpec,
    levels: tuple[int | str, ...],
    inner: tuple[int, ...],
    text: str,
    where: str,
) -> None:
    """Check a parsed concrete shape against the format's symbolic shape."""
    bad = (
        f"{where}.engine_kv_concrete_shape {text!r} does not fit {spec.name} "
        f"({spec.symbolic_shape})"
    )
    if len(levels) != len(spec.list_levels) or len(inner) != len(spec.inner_dims):
        raise KVCacheSDKError(bad)
    for got, label in zip(levels, spec.list_levels, strict=True):
        if label == "NP":
            ok = got == "NP" or (isinstance(got, int) and got >= 1)
        elif label in LITERAL_LABELS:
            ok = got == int(label)
        else:
            ok = isinstance(got, int)
        if not ok:
            raise KVCacheSDKError(f"{bad}: list level {label} is {got!r}")
    for i, (got_dim, label) in enumerate(zip(inner, spec.inner_dims, strict=True)):
        if label in LITERAL_LABELS and label != "NP" and got_dim != int(label):
            raise KVCacheSDKError(f"{bad}: dim {i} ({label}) is {got_dim}")
        if label not in LITERAL_LABELS and got_dim < 1:
            raise KVCacheSDKError(f"{bad}: dim {i} ({label}) is {got_dim}")


def _bytes_per_token(planes: int, layers: int, hidden: int, itemsize: int, ratio: int) -> int:
    """Bytes per logical token of one group, as the server computes it."""
    return planes * layers * hidden * itemsize // ratio


def _decode_group(
    kg: Mapping[str, Any],
    *,
    cache_size_per_token: int | None,
    where: str,
    position: int,
    require_hidden: bool,
) -> DecodedGroup:
    kg = _dict(kg, where)
    spec = get_format(_str(_get(kg, "engine_kv_format", where), f"{where}.engine_kv_format"))
    text = _get(kg, "engine_kv_concrete_shape", where)
    if not isinstance(text, str):
        raise KVCacheSDKError(
            f"{where}.engine_kv_concrete_shape: expected a str, got {_describe(text)}"
        )
    num_layers = _int(_get(kg, "num_layers", where), f"{where}.num_layers", minimum=1)
    layer_indices = _int_list(_get(kg, "layer_indices", where), f"{where}.layer_indices")
    if len(layer_indices) != num_layers:
        raise KVCacheSDKError(
            f"{where}.layer_indices has {len(layer_indices)} entries but "
            f"{where}.num_layers is {num_layers}"
        )
    tokens_per_block = _int(
        _get(kg, "tokens_per_block", where), f"{where}.tokens_per_block", minimum=1
    )
    slots_per_block = _int(
        _get(kg, "slots_per_block", where), f"{where}.slots_per_block", minimum=1
    )
    dtype, itemsize = _dtype(_get(kg, "dtype", where), f"{where}.dtype")
    kernel_group_idx = _int(kg.get("kernel_group_idx", position), f"{where}.kernel_group_idx")
    engine_group_idx = _int(kg.get("engine_group_idx", 0), f"{where}.engine_group_idx")
    object_group_idx = _int(kg.get("object_group_idx", 0), f"{where}.object_group_idx")
    if "is_mla" in kg:
        is_mla = kg["is_mla"]
        if not isinstance(is_mla, bool):
            raise KVCacheSDKError(f"{where}.is_mla: expected a bool, got {_describe(is_mla)}")
        if is_mla != spec.is_mla:
            raise KVCacheSDKError(
                f"{where}.is_mla is {is_mla} but format {spec.name} is "
                f"{'' if spec.is_mla else 'not '}MLA: the server's format table differs "
                "from LMCache 0.5.6's"
            )
    shown = kg.get("engine_kv_shape")
    if isinstance(shown, str) and shown != spec.symbolic_shape:
        logger.warning(
            "%s.engine_kv_shape is %r, expected %r for %s; decoding by the format name",
            where, shown, spec.symbolic_shape, spec.name,
        )

    # Read what the concrete shape carries.
    num_heads: int | None = 1 if spec.is_mla else None
    printed_head: int | None = None
    if text.strip().startswith(_UNKNOWN_PREFIX):
        if spec.status_shape_known:
            raise KVCacheSDKError(
                f"{where}.engine_kv_concrete_shape is {text!r}, but LMCache 0.5.6 prints "
                f"a concrete shape for {spec.name}"
            )
    else:
        levels, inner = parse_concrete_shape(text)
        _match_template(spec, levels, inner, text, where)
        nl = levels[spec.nl_level] if spec.nl_level is not None else None
        if spec.nl_index is not None:
            nl = inner[spec.nl_index]
        if nl != num_layers:
            raise KVCacheSDKError(
                f"{where}.engine_kv_concrete_shape {text!r} has NL = {nl} but "
                f"{where}.num_layers is {num_layers}"
            )
        if spec.bs_index is not None and inner[spec.bs_index] != slots_per_block:
            raise KVCacheSDKError(
                f"{where}.engine_kv_concrete_shape {text!r} has BS = {inner[spec.bs_index]}"
                f" but {where}.slots_per_block is {slots_per_block}"
            )
        if spec.pbs_index is not None and inner[spec.pbs_index] % slots_per_block:
            raise KVCacheSDKError(
                f"{where}.engine_kv_concrete_shape {text!r} has PBS = "
                f"{inner[spec.pbs_index]}, not a multiple of slots_per_block "
                f"{slots_per_block}"
            )
        if spec.nh_index is not None:
            num_heads = inner[spec.nh_index]
        if spec.head_index is not None:
            printed_head = inner[spec.head_index]

    ratio = max(1, tokens_per_block // slots_per_block)
    planes = spec.kv_size

    def expected(hidden: int) -> int:
        return _bytes_per_token(planes, num_layers, hidden, itemsize, ratio)

    head_size: int | None = None
    hidden: int | None = None
    if printed_head is not None and num_heads is not None:
        candidates = [printed_head * m for m in spec.head_size_multipliers]
        chosen = candidates[0]
        if cache_size_per_token is not None:
            matching = [h for h in candidates if expected(num_heads * h) == cache_size_per_token]
            if not matching:
                raise KVCacheSDKError(
                    f"{where}: decoded {spec.name} {text!r} as planes {planes} x layers "
                    f"{num_layers} x D {num_heads * chosen} (NH {num_heads} x head_size "
                    f"{chosen}) x {itemsize} B = {expected(num_heads * chosen)} bytes per "
                    f"token, but cache_size_per_token is {cache_size_per_token}"
                )
            chosen = matching[0]
        head_size, hidden = chosen, num_heads * chosen
    elif cache_size_per_token is not None:
        unit = planes * num_layers * itemsize
        derived, rest = divmod(cache_size_per_token * ratio, unit)
        if rest or derived < 1 or expected(derived) != cache_size_per_token:
            raise KVCacheSDKError(
                f"{where}: cannot derive D for {spec.name} from cache_size_per_token "
                f"{cache_size_per_token}: not a positive multiple of planes {planes} x "
                f"layers {num_layers} x {itemsize} B"
            )
        hidden = derived
        if num_heads is not None:
            if hidden % num_heads:
                raise KVCacheSDKError(
                    f"{where}: derived D {hidden} is not a multiple of NH {num_heads}"
                )
            head_size = hidden // num_heads
    elif require_hidden:
        raise KVCacheSDKError(
            f"{where}: the concrete shape {text!r} of {spec.name} does not carry the "
            "hidden size; it can only be derived from cache_size_per_token of a "
            "single-group entry"
        )

    return DecodedGroup(
        format_name=spec.name,
        format_value=spec.value,
        kernel_group_idx=kernel_group_idx,
        engine_group_idx=engine_group_idx,
        object_group_idx=object_group_idx,
        planes=planes,
        num_layers=num_layers,
        layer_indices=layer_indices,
        num_heads=num_heads,
        head_size=head_size,
        hidden_size=hidden,
        block_size=tokens_per_block,
        slots_per_block=slots_per_block,
        dtype=dtype,
        itemsize=itemsize,
        is_mla=spec.is_mla,
        concrete_shape=text,
    )


def decode_kernel_group(
    kg: Mapping[str, Any],
    *,
    cache_size_per_token: int | None,
    where: str = "kernel_groups[0]",
) -> DecodedGroup:
    """Decode one ``kernel_groups`` element of a ``/status`` entry.

    Args:
        kg: The kernel-group object.
        cache_size_per_token: The entry's ``cache_size_per_token`` when the entry
            has exactly this one group: it is cross-checked against
            ``planes * L * D * itemsize`` (and picks the head size of the ambiguous
            ``..._TWO_HS`` formats), and is the only source of D for formats
            whose concrete shape is ``"Unknown (...)"``. ``None`` skips both.
        where: Field path used in error messages.

    Returns:
        The group's per-shard geometry.

    Raises:
        KVCacheSDKError: A field is missing or ill-typed; the format is unknown; the
            concrete shape does not fit the format or disagrees with ``num_layers``
            or ``slots_per_block``; the geometry disagrees with
            ``cache_size_per_token``; or D cannot be determined.

    """
    if cache_size_per_token is not None:
        _int(cache_size_per_token, "cache_size_per_token", minimum=1)
    return _decode_group(
        kg, cache_size_per_token=cache_size_per_token, where=where, position=0,
        require_hidden=True,
    )


def kernel_groups_of(entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Return the validated ``kv_cache_layout.kernel_groups`` list of an entry.

    Args:
        entry: One ``cache_context_meta`` value.

    Returns:
        The kernel-group objects, in order (at least one).

    Raises:
        KVCacheSDKError: The entry, its ``kv_cache_layout`` or ``kernel_groups`` is
            missing, ill-typed or empty.

    """
    entry = _dict(entry, "cache_context_meta entry")
    layout = _dict(
        _get(entry, "kv_cache_layout", "entry"), "entry.kv_cache_layout"
    )
    groups = _get(layout, "kernel_groups", "entry.kv_cache_layout")
    if not isinstance(groups, list) or not groups:
        raise KVCacheSDKError(
            "entry.kv_cache_layout.kernel_groups: expected a non-empty list, got "
            f"{_describe(groups)}"
        )
    return [
        _dict(kg, f"entry.kv_cache_layout.kernel_groups[{i}]") for i, kg in enumerate(groups)
    ]


def decode_status_entry(entry: Mapping[str, Any], chunk_size: int) -> DecodedEntry:
    """Decode one ``cache_context_meta`` entry and derive the chunk object (§6.3).

    Args:
        entry: One value of ``/status`` ``cache_context_meta``.
        chunk_size: The server's ``chunk_size`` (``/config`` ``mp.chunk_size``).

    Returns:
        The decoded entry. ``chunk`` is set when the entry has exactly one kernel
        group; a hybrid entry decodes into per-group layouts with ``chunk=None``
        (see :meth:`DecodedEntry.require_single_group`).

    Raises:
        KVCacheSDKError: A field is missing or ill-typed, a group does not decode
            (see :func:`decode_kernel_group`), or, for a single-group entry,
            ``chunk_size`` is not a multiple of the block size or
            ``slots_per_block != tokens_per_block``.

    """
    chunk_size = _int(chunk_size, "chunk_size", minimum=1)
    kgs = kernel_groups_of(entry)
    model_name = _str(_get(entry, "model_name", "entry"), "entry.model_name")
    world_size = _int(_get(entry, "world_size", "entry"), "entry.world_size", minimum=1)
    layout = entry["kv_cache_layout"]
    where = "entry.kv_cache_layout"
    num_layers = _int(_get(layout, "num_layers", where), f"{where}.num_layers", minimum=1)
    num_blocks = layout.get("num_blocks")
    if num_blocks is not None:
        num_blocks = _int(num_blocks, f"{where}.num_blocks")
    cps = _int(
        _get(layout, "cache_size_per_token", where), f"{where}.cache_size_per_token", minimum=1
    )

    if len(kgs) == 1:
        group = _decode_group(
            kgs[0], cache_size_per_token=cps, where=f"{where}.kernel_groups[0]",
            position=0, require_hidden=True,
        )
        groups: tuple[DecodedGroup, ...] = (group,)
        chunk = _chunk_object(group, chunk_size, model_name)
        if group.num_layers != num_layers:
            logger.debug(
                "model %r: kernel group has %d layers of %d registered tensors (the "
                "rest share another layer's KV); objects carry the group's layers",
                model_name, group.num_layers, num_layers,
            )
    else:
        groups = _decode_hybrid(kgs, cps, where, model_name)
        chunk = None
    return DecodedEntry(
        model_name=model_name,
        world_size=world_size,
        chunk_size=chunk_size,
        num_layers=num_layers,
        num_blocks=num_blocks,
        cache_size_per_token=cps,
        groups=groups,
        chunk=chunk,
    )


def _chunk_object(group: DecodedGroup, chunk_size: int, model_name: str) -> ChunkObject:
    if group.slots_per_block != group.block_size:
        raise KVCacheSDKError(
            f"model {model_name!r}: slots_per_block {group.slots_per_block} != "
            f"tokens_per_block {group.block_size} (a compressed KV group); the "
            "engine-driven path needs one physical slot per token (docs/protocol.md §8.6)"
        )
    if chunk_size % group.block_size:
        raise KVCacheSDKError(
            f"model {model_name!r}: the server's chunk_size {chunk_size} is not a multiple "
            f"of the block size {group.block_size}"
        )
    if group.hidden_size is None:  # pragma: no cover - single groups always decode D
        raise KVCacheSDKError(f"model {model_name!r}: the hidden size could not be decoded")
    return ChunkObject(
        planes=group.planes,
        num_layers=group.num_layers,
        hidden_size=group.hidden_size,
        dtype=group.dtype,
        itemsize=group.itemsize,
        block_size=group.block_size,
        chunk_size=chunk_size,
        num_physical_slots=(chunk_size // group.block_size) * group.block_size,
    )


def _decode_hybrid(
    kgs: Sequence[Mapping[str, Any]], cps: int, where: str, model_name: str
) -> tuple[DecodedGroup, ...]:
    """Decode every group of a multi-group entry.

    ``cache_size_per_token`` is a sum over groups, so it cannot check one group; it
    is checked against the sum, or, when exactly one group's D is unknown, gives
    that group's D as the remainder. Disagreement is logged, not raised: refusing
    hybrids is :meth:`DecodedEntry.require_single_group`'s job.
    """
    groups = [
        _decode_group(
            kg, cache_size_per_token=None, where=f"{where}.kernel_groups[{i}]", position=i,
            require_hidden=False,
        )
        for i, kg in enumerate(kgs)
    ]
    unknown = [i for i, g in enumerate(groups) if g.hidden_size is None]
    known_bytes = sum(
        _bytes_per_token(g.planes, g.num_layers, g.hidden_size, g.itemsize, g.compress_ratio)
        for g in groups
        if g.hidden_size is not None
    )
    if not unknown:
        if known_bytes != cps:
            logger.warning(
                "model %r: the kernel groups decode to %d bytes per token but "
                "cache_size_per_token is %d", model_name, known_bytes, cps,
            )
    elif len(unknown) == 1 and cps > known_bytes:
        i = unknown[0]
        try:
            groups[i] = _decode_group(
                kgs[i], cache_size_per_token=cps - known_bytes,
                where=f"{where}.kernel_groups[{i}]", position=i, require_hidden=True,
            )
        except KVCacheSDKError as err:
            logger.warning("model %r: %s", model_name, err)
    return tuple(groups)


def find_model_entries(
    status: Mapping[str, Any], model_name: str
) -> list[tuple[str, Mapping[str, Any]]]:
    """Find a model's vLLM registrations in a ``/status`` reply.

    Args:
        status: The decoded ``GET /status`` JSON.
        model_name: The model name to match exactly.

    Returns:
        ``(instance_id, entry)`` pairs in the server's order; a tensor-parallel
        deployment has one per rank. Empty when the model has no lmcache-driven
        registration (or the server publishes no ``cache_context_meta``).

    Raises:
        KVCacheSDKError: ``status`` or its ``cache_context_meta`` is not an object.

    """
    status = _dict(status, "/status")
    meta = status.get("cache_context_meta")
    if meta is None:
        return []
    meta = _dict(meta, "/status cache_context_meta")
    found: list[tuple[str, Mapping[str, Any]]] = []
    for instance_id, entry in meta.items():
        if not isinstance(entry, Mapping):
            logger.warning(
                "/status cache_context_meta[%r] is not an object (%s); ignored",
                instance_id, type(entry).__name__,
            )
            continue
        if entry.get("model_name") == model_name:
            found.append((str(instance_id), entry))
    return found
