"""Decode one ``kernel_groups`` element of a ``/status`` entry into a :class:`DecodedGroup`.

The format name picks the row of the format table (:mod:`~lmcache_kv_fast.layout.formats`);
the concrete shape gives the layers, heads and head size it prints; the entry's
``cache_size_per_token`` checks them, or is the only source of D when the shape does not
carry it (docs/protocol.md §6).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.concrete_shape import (
    UNKNOWN_PREFIX,
    match_template,
    parse_concrete_shape,
)
from lmcache_kv_fast.layout.decoded import DecodedGroup
from lmcache_kv_fast.layout.formats import get_format
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
    kernel_group_idx = check_int(kg.get("kernel_group_idx", position), f"{where}.kernel_group_idx")
    engine_group_idx = check_int(kg.get("engine_group_idx", 0), f"{where}.engine_group_idx")
    object_group_idx = check_int(kg.get("object_group_idx", 0), f"{where}.object_group_idx")
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

    # Read what the concrete shape carries.
    num_heads: int | None = 1 if spec.is_mla else None
    printed_head: int | None = None
    if text.strip().startswith(UNKNOWN_PREFIX):
        if spec.status_shape_known:
            raise KVCacheSDKError(
                f"{where}.engine_kv_concrete_shape is {text!r}, but LMCache 0.5.6 prints "
                f"a concrete shape for {spec.name}"
            )
    else:
        levels, inner = parse_concrete_shape(text)
        match_template(spec, levels, inner, text, where)
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
        return bytes_per_token(planes, num_layers, hidden, itemsize, ratio)

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
        check_int(cache_size_per_token, "cache_size_per_token", minimum=1)
    return decode_group(
        kg, cache_size_per_token=cache_size_per_token, where=where, position=0,
        require_hidden=True,
    )
