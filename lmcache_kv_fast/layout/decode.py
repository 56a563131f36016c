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

This module decodes whole entries (and finds them in ``/status``); the parts live in
:mod:`~lmcache_kv_fast.layout.status_fields` (checked field access),
:mod:`~lmcache_kv_fast.layout.concrete_shape` (the shape string),
:mod:`~lmcache_kv_fast.layout.decode_group` (one kernel group) and
:mod:`~lmcache_kv_fast.layout.decoded` (the result types), all importable from here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.concrete_shape import parse_concrete_shape
from lmcache_kv_fast.layout.decode_group import bytes_per_token, decode_group, decode_kernel_group
from lmcache_kv_fast.layout.decoded import (
    ChunkObject,
    DecodedEntry,
    DecodedGroup,
    format_layer_indices,
)
from lmcache_kv_fast.layout.status_fields import (
    check_int,
    check_object,
    check_str,
    kernel_groups_of,
    require_key,
)

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
    chunk_size = check_int(chunk_size, "chunk_size", minimum=1)
    kgs = kernel_groups_of(entry)
    model_name = check_str(require_key(entry, "model_name", "entry"), "entry.model_name")
    world_size = check_int(require_key(entry, "world_size", "entry"), "entry.world_size", minimum=1)
    layout = entry["kv_cache_layout"]
    where = "entry.kv_cache_layout"
    num_layers = check_int(require_key(layout, "num_layers", where), f"{where}.num_layers", minimum=1)
    num_blocks = layout.get("num_blocks")
    if num_blocks is not None:
        num_blocks = check_int(num_blocks, f"{where}.num_blocks")
    cps = check_int(
        require_key(layout, "cache_size_per_token", where), f"{where}.cache_size_per_token", minimum=1
    )

    if len(kgs) == 1:
        group = decode_group(
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
        decode_group(
            kg, cache_size_per_token=None, where=f"{where}.kernel_groups[{i}]", position=i,
            require_hidden=False,
        )
        for i, kg in enumerate(kgs)
    ]
    unknown = [i for i, g in enumerate(groups) if g.hidden_size is None]
    known_bytes = sum(
        bytes_per_token(g.planes, g.num_layers, g.hidden_size, g.itemsize, g.compress_ratio)
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
            groups[i] = decode_group(
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
    status = check_object(status, "/status")
    meta = status.get("cache_context_meta")
    if meta is None:
        return []
    meta = check_object(meta, "/status cache_context_meta")
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
