"""Decode one ``kernel_groups`` element of a ``/status`` entry into a :class:`DecodedGroup`.

The format name picks the row of the format table (:mod:`~lmcache_kv_fast.layout.formats`);
the concrete shape gives the layers, heads and head size it prints; the entry's
``cache_size_per_token`` checks them, or is the only source of D when the shape does not
carry it (docs/protocol.md §6).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.concrete_shape import (
    UNKNOWN_PREFIX,
    match_template,
    parse_concrete_shape,
)
from lmcache_kv_fast.layout.decoded import DecodedGroup
from lmcache_kv_fast.layout.formats import FormatSpec, get_format
from lmcache_kv_fast.layout.status_fields import (
    check_dtype,
    check_int,
    check_int_list,
    check_object,
    check_str,
    describe_value,
    require_key,
)

__all__ = ["bytes_per_token", "decode_group", "decode_kernel_group"]

logger = logging.getLogger(__name__)


def bytes_per_token(planes: int, layers: int, hidden: int, itemsize: int, ratio: int) -> int:
    """Bytes per logical token of one group, as the server computes it."""
    return planes * layers * hidden * itemsize // ratio


def decode_group(
    kg: Mapping[str, Any],
    *,
    cache_size_per_token: int | None,
    where: str,
    position: int,
    require_hidden: bool,
) -> DecodedGroup:
    """Decode one kernel group (:func:`decode_kernel_group` without the argument checks).

    ``position`` is the group's index (the default ``kernel_group_idx``);
    ``require_hidden=False`` leaves D unknown (``None``) instead of raising when neither
    the concrete shape nor ``cache_size_per_token`` gives it (a hybrid entry's group).
    """
    kg = check_object(kg, where)
    fields = _read_fields(kg, where, position)
    _check_declared_format(kg, fields)
    num_heads, printed_head = _heads_in_shape(fields)
    head_size: int | None = None
    hidden: int | None = None
    if printed_head is not None and num_heads is not None:
        head_size, hidden = _from_printed_head(fields, num_heads, printed_head,
                                               cache_size_per_token)
    elif cache_size_per_token is not None:
        head_size, hidden = _from_cache_size(fields, num_heads, cache_size_per_token)
    elif require_hidden:
        raise KVCacheSDKError(
            f"{where}: the concrete shape {fields.text!r} of {fields.spec.name} does not "
            "carry the hidden size; it can only be derived from cache_size_per_token of a "
            "single-group entry"
        )
    return fields.decoded(num_heads=num_heads, head_size=head_size, hidden_size=hidden)


@dataclass(frozen=True)
class _GroupFields:
    """A kernel group's checked fields, before the concrete shape is read."""

    where: str
    spec: FormatSpec
    text: str
    num_layers: int
    layer_indices: tuple[int, ...]
    tokens_per_block: int
    slots_per_block: int
    dtype: str
    itemsize: int
    kernel_group_idx: int
    engine_group_idx: int
    object_group_idx: int

    @property
    def ratio(self) -> int:
        """Logical tokens per physical slot (above 1 for a compressed group)."""
        return max(1, self.tokens_per_block // self.slots_per_block)

    def bytes_for(self, hidden: int) -> int:
        """Bytes per logical token if D is ``hidden``, as the server computes them."""
        return bytes_per_token(self.spec.kv_size, self.num_layers, hidden, self.itemsize,
                               self.ratio)

    def decoded(self, *, num_heads: int | None, head_size: int | None,
                hidden_size: int | None) -> DecodedGroup:
        """The :class:`DecodedGroup` of these fields and the decoded head geometry."""
        return DecodedGroup(
            format_name=self.spec.name,
            format_value=self.spec.value,
            kernel_group_idx=self.kernel_group_idx,
            engine_group_idx=self.engine_group_idx,
            object_group_idx=self.object_group_idx,
            planes=self.spec.kv_size,
            num_layers=self.num_layers,
            layer_indices=self.layer_indices,
            num_heads=num_heads,
            head_size=head_size,
            hidden_size=hidden_size,
            block_size=self.tokens_per_block,
            slots_per_block=self.slots_per_block,
            dtype=self.dtype,
            itemsize=self.itemsize,
            is_mla=self.spec.is_mla,
            concrete_shape=self.text,
        )


def _read_fields(kg: Mapping[str, Any], where: str, position: int) -> _GroupFields:
    """Check the group's fields in the order that decides which error a bad group gets."""
    spec = get_format(check_str(require_key(kg, "engine_kv_format", where), f"{where}.engine_kv_format"))
    text = require_key(kg, "engine_kv_concrete_shape", where)
    if not isinstance(text, str):
        raise KVCacheSDKError(
            f"{where}.engine_kv_concrete_shape: expected a str, got {describe_value(text)}"
        )
    num_layers = check_int(require_key(kg, "num_layers", where), f"{where}.num_layers", minimum=1)
    layer_indices = check_int_list(require_key(kg, "layer_indices", where), f"{where}.layer_indices")
    if len(layer_indices) != num_layers:
        raise KVCacheSDKError(
            f"{where}.layer_indices has {len(layer_indices)} entries but "
            f"{where}.num_layers is {num_layers}"
        )
    tokens_per_block = check_int(
        require_key(kg, "tokens_per_block", where), f"{where}.tokens_per_block", minimum=1
    )
    slots_per_block = check_int(
        require_key(kg, "slots_per_block", where), f"{where}.slots_per_block", minimum=1
    )
    dtype, itemsize = check_dtype(require_key(kg, "dtype", where), f"{where}.dtype")
    return _GroupFields(
        where=where, spec=spec, text=text, num_layers=num_layers, layer_indices=layer_indices,
        tokens_per_block=tokens_per_block, slots_per_block=slots_per_block, dtype=dtype,
        itemsize=itemsize,
        kernel_group_idx=check_int(kg.get("kernel_group_idx", position),
                                   f"{where}.kernel_group_idx"),
        engine_group_idx=check_int(kg.get("engine_group_idx", 0), f"{where}.engine_group_idx"),
        object_group_idx=check_int(kg.get("object_group_idx", 0), f"{where}.object_group_idx"),
    )


def _check_declared_format(kg: Mapping[str, Any], fields: _GroupFields) -> None:
    """Refuse an ``is_mla`` the format contradicts; log an unexpected ``engine_kv_shape``.

    The format name decides the decoding; these optional fields only cross-check it.
    """
    where, spec = fields.where, fields.spec
    if "is_mla" in kg:
        is_mla = kg["is_mla"]
        if not isinstance(is_mla, bool):
            raise KVCacheSDKError(f"{where}.is_mla: expected a bool, got {describe_value(is_mla)}")
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


def _heads_in_shape(fields: _GroupFields) -> tuple[int | None, int | None]:
    """``(NH, printed head size)`` the concrete shape carries, each ``None`` if absent.

    An MLA format's NH is 1 even when the shape is ``"Unknown (...)"``. The shape's
    NL, BS and PBS are checked against the group's fields.
    """
    spec, text, where = fields.spec, fields.text, fields.where
    num_heads: int | None = 1 if spec.is_mla else None
    if text.strip().startswith(UNKNOWN_PREFIX):
        if spec.status_shape_known:
            raise KVCacheSDKError(
                f"{where}.engine_kv_concrete_shape is {text!r}, but LMCache 0.5.6 prints "
                f"a concrete shape for {spec.name}"
            )
        return num_heads, None
    levels, inner = parse_concrete_shape(text)
    match_template(spec, levels, inner, text, where)
    _check_shape_counts(fields, levels, inner)
    if spec.nh_index is not None:
        num_heads = inner[spec.nh_index]
    printed_head = inner[spec.head_index] if spec.head_index is not None else None
    return num_heads, printed_head


def _check_shape_counts(
    fields: _GroupFields, levels: tuple[int | str, ...], inner: tuple[int, ...]
) -> None:
    """The shape's NL must be ``num_layers``, its BS ``slots_per_block``, its PBS a multiple."""
    spec, text, where = fields.spec, fields.text, fields.where
    nl = levels[spec.nl_level] if spec.nl_level is not None else None
    if spec.nl_index is not None:
        nl = inner[spec.nl_index]
    if nl != fields.num_layers:
        raise KVCacheSDKError(
            f"{where}.engine_kv_concrete_shape {text!r} has NL = {nl} but "
            f"{where}.num_layers is {fields.num_layers}"
        )
    slots = fields.slots_per_block
    if spec.bs_index is not None and inner[spec.bs_index] != slots:
        raise KVCacheSDKError(
            f"{where}.engine_kv_concrete_shape {text!r} has BS = {inner[spec.bs_index]}"
            f" but {where}.slots_per_block is {slots}"
        )
    if spec.pbs_index is not None and inner[spec.pbs_index] % slots:
        raise KVCacheSDKError(
            f"{where}.engine_kv_concrete_shape {text!r} has PBS = "
            f"{inner[spec.pbs_index]}, not a multiple of slots_per_block "
            f"{slots}"
        )


def _from_printed_head(
    fields: _GroupFields, num_heads: int, printed_head: int, cache_size_per_token: int | None
) -> tuple[int, int]:
    """``(head size, D)`` from the printed head size, checked against the bytes per token.

    The printed value of a ``..._TWO_HS`` format is ambiguous (packed or per half); the
    first reading is 0.5.6's and ``cache_size_per_token``, when given, picks.
    """
    spec = fields.spec
    candidates = [printed_head * m for m in spec.head_size_multipliers]
    chosen = candidates[0]
    if cache_size_per_token is not None:
        matching = [h for h in candidates
                    if fields.bytes_for(num_heads * h) == cache_size_per_token]
        if not matching:
            raise KVCacheSDKError(
                f"{fields.where}: decoded {spec.name} {fields.text!r} as planes "
                f"{spec.kv_size} x layers {fields.num_layers} x D {num_heads * chosen} (NH "
                f"{num_heads} x head_size {chosen}) x {fields.itemsize} B = "
                f"{fields.bytes_for(num_heads * chosen)} bytes per token, but "
                f"cache_size_per_token is {cache_size_per_token}"
            )
        chosen = matching[0]
    return chosen, num_heads * chosen


def _from_cache_size(
    fields: _GroupFields, num_heads: int | None, cache_size_per_token: int
) -> tuple[int | None, int]:
    """``(head size or None, D)`` from ``cache_size_per_token`` alone."""
    where, planes = fields.where, fields.spec.kv_size
    unit = planes * fields.num_layers * fields.itemsize
    derived, rest = divmod(cache_size_per_token * fields.ratio, unit)
    if rest or derived < 1 or fields.bytes_for(derived) != cache_size_per_token:
        raise KVCacheSDKError(
            f"{where}: cannot derive D for {fields.spec.name} from cache_size_per_token "
            f"{cache_size_per_token}: not a positive multiple of planes {planes} x "
            f"layers {fields.num_layers} x {fields.itemsize} B"
        )
    if num_heads is None:
        return None, derived
    if derived % num_heads:
        raise KVCacheSDKError(f"{where}: derived D {derived} is not a multiple of NH {num_heads}")
    return derived // num_heads, derived


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
        check_int(cache_size_per_token, "cache_size_per_token", minimum=1)
    return decode_group(
        kg, cache_size_per_token=cache_size_per_token, where=where, position=0,
        require_hidden=True,
    )
