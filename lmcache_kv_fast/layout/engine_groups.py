"""Engine KV-cache groups: which layers share one paged-block address space.

A serving engine with a hybrid KV cache (e.g. full attention + sliding window)
exposes several *engine groups*; a block id only means something inside its own
group. LMCache describes this as a ``list[EngineGroupInfo]`` in protocol order (one
entry per LMCache KV group; several entries may share an engine group), sent with
``register_kv_cache`` and used to split block ids per group (docs/protocol.md §4.6). An
empty list means one non-hybrid group. Engine group ids are dense from 0.

The helpers here mirror LMCache 0.5.6's ``multiprocess/group_view.py`` behaviour
(written afresh; ``lmcache`` is never imported), and add clearer errors for inputs
LMCache would crash on with ``IndexError`` / ``ZeroDivisionError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any, cast

from lmcache_kv_fast.layout.status_fields import check_int, check_int_list, kernel_groups_of
from lmcache_kv_fast.protocol.types import EngineGroupInfo

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "EngineGroupInfo",
    "engine_group_layer_indices",
    "expand_engine_block_ids",
    "get_engine_group_indices",
    "groups_from_status_entry",
    "num_engine_group_infos",
    "num_engine_groups",
    "slice_block_ids_per_group",
]

#: Marker in :func:`get_engine_group_indices` for a registered tensor that no group
#: references (a KV-sharing layer whose KV lives in another layer's blocks).
EXCLUDED_ENGINE_GROUP = -1


def num_engine_groups(groups: Sequence[EngineGroupInfo]) -> int:
    """Count the engine groups, i.e. the block-id lists of one transfer request.

    Args:
        groups: LMCache KV groups in protocol order.

    Returns:
        ``max(engine_group_id) + 1``; 1 for an empty ``groups`` (one non-hybrid
        group).

    """
    if not groups:
        return 1
    return 1 + max(g.engine_group_id for g in groups)


def num_engine_group_infos(groups: Sequence[EngineGroupInfo]) -> int:
    """Count the LMCache KV groups a transfer request is indexed by.

    Args:
        groups: LMCache KV groups in protocol order.

    Returns:
        ``len(groups)``; 1 for an empty ``groups``.

    """
    return len(groups) or 1


def _source_engine_groups(groups: Sequence[EngineGroupInfo]) -> list[int]:
    """Engine group id each LMCache group reads its block ids from (``[0]`` if empty)."""
    return [g.engine_group_id for g in groups] or [0]


def engine_group_layer_indices(groups: Sequence[EngineGroupInfo]) -> list[list[int]]:
    """Collect each engine group's layers, indexed by engine group id.

    LMCache groups that share an engine group contribute their layers to it.

    Args:
        groups: LMCache KV groups in protocol order.

    Returns:
        One sorted layer-index list per engine group id ``0..max``; empty for an
        empty ``groups``. An id no group uses gets an empty list.

    """
    if not groups:
        return []
    per_group: list[list[int]] = [[] for _ in range(num_engine_groups(groups))]
    for g in groups:
        per_group[g.engine_group_id].extend(g.layer_indices)
    return [sorted(layers) for layers in per_group]


def expand_engine_block_ids(
    groups: Sequence[EngineGroupInfo],
    engine_side_block_ids: Sequence[Sequence[int]] | Sequence[int],
) -> list[list[int]]:
    """Re-index engine-side block ids by LMCache KV group.

    The engine reports one block-id list per engine group; each LMCache group uses
    a copy of its engine group's list.

    Args:
        groups: LMCache KV groups in protocol order.
        engine_side_block_ids: One block-id list per engine group id, or (older
            connectors, one non-hybrid group) a flat list of block ids, which is
            taken as engine group 0's list. An empty sequence means "no blocks".

    Returns:
        One new block-id list per LMCache group (one list for an empty ``groups``).

    Raises:
        ValueError: A group reads an engine group id that has no list.

    """
    sources = _source_engine_groups(groups)
    if len(engine_side_block_ids) == 0:
        return [[] for _ in sources]
    if isinstance(engine_side_block_ids[0], Integral):
        per_engine_group: Sequence[Sequence[int]] = [cast("Sequence[int]", engine_side_block_ids)]
    else:
        per_engine_group = cast("Sequence[Sequence[int]]", engine_side_block_ids)
    out: list[list[int]] = []
    for view, engine_group_id in enumerate(sources):
        if not 0 <= engine_group_id < len(per_engine_group):
            raise ValueError(
                f"LMCache group {view} reads engine group {engine_group_id}, but block ids "
                f"were given for {len(per_engine_group)} engine group(s)"
            )
        out.append(list(per_engine_group[engine_group_id]))
    return out


def slice_block_ids_per_group(
    allocated_block_ids: Mapping[int, Sequence[int]],
    group_tokens_per_block: Sequence[int],
    start_token_idx: int,
    end_token_idx: int,
) -> list[list[int]]:
    """Cut each engine group's block ids down to a token range.

    Tokens are the one unit all groups share: a group whose blocks cover ``n``
    tokens each holds one block id per ``n`` tokens, so over the same 256 tokens a
    64-token-block group gets 4 ids and a 256-token-block group gets 1.

    Args:
        allocated_block_ids: Block ids keyed by engine group id; a missing group
            counts as an empty list.
        group_tokens_per_block: Tokens per block of each engine group, in engine
            group order; each must be positive and divide both range ends.
        start_token_idx: First token of the range (inclusive).
        end_token_idx: End of the range (exclusive).

    Returns:
        One block-id list per engine group, in engine group order.

    Raises:
        ValueError: A non-positive ``tokens_per_block``, a negative or reversed
            range, or a range end that is not on a block boundary of some group.

    """
    if start_token_idx < 0 or end_token_idx < start_token_idx:
        raise ValueError(
            f"token range [{start_token_idx}, {end_token_idx}) is not a valid range"
        )
    sliced: list[list[int]] = []
    for group, tokens_per_block in enumerate(group_tokens_per_block):
        if tokens_per_block <= 0:
            raise ValueError(
                f"group {group} tokens_per_block must be positive, got {tokens_per_block}"
            )
        if start_token_idx % tokens_per_block or end_token_idx % tokens_per_block:
            raise ValueError(
                f"token range [{start_token_idx}, {end_token_idx}) does not align to "
                f"group {group} tokens_per_block {tokens_per_block}"
            )
        block_ids = allocated_block_ids.get(group, ())
        sliced.append(
            list(block_ids[start_token_idx // tokens_per_block : end_token_idx // tokens_per_block])
        )
    return sliced


def get_engine_group_indices(
    groups: Sequence[EngineGroupInfo], num_registered_layers: int
) -> list[int] | None:
    """Map every registered KV tensor to its engine group id.

    Args:
        groups: LMCache KV groups in protocol order.
        num_registered_layers: Number of KV tensors registered with the server.

    Returns:
        A list of ``num_registered_layers`` engine group ids, with
        :data:`EXCLUDED_ENGINE_GROUP` for tensors no group references; ``None``
        when there is no group metadata (empty ``groups`` or zero layers), meaning
        single-group behaviour.

    Raises:
        ValueError: ``num_registered_layers`` is negative, or a group references a
            layer outside ``[0, num_registered_layers)``.

    """
    if num_registered_layers < 0:
        raise ValueError(f"num_registered_layers must be >= 0, got {num_registered_layers}")
    if not groups or num_registered_layers == 0:
        return None
    per_layer = [EXCLUDED_ENGINE_GROUP] * num_registered_layers
    for g in groups:
        for layer in g.layer_indices:
            if not 0 <= layer < num_registered_layers:
                raise ValueError(
                    f"Layer index {layer} is outside registered layer range "
                    f"[0, {num_registered_layers})"
                )
            per_layer[layer] = g.engine_group_id
    return per_layer


def groups_from_status_entry(entry: Mapping[str, Any]) -> list[EngineGroupInfo]:
    """Rebuild the engine-group list of a ``/status`` ``cache_context_meta`` entry.

    Each kernel group maps to one :class:`EngineGroupInfo` (``engine_group_idx``,
    ``layer_indices``, ``tokens_per_block``). ``/status`` does not publish sliding
    windows, object-group tags or recurrent-state flags, so those keep their
    defaults (full attention).

    Args:
        entry: One value of ``cache_context_meta``.

    Returns:
        One :class:`EngineGroupInfo` per kernel group, in kernel-group order.

    Raises:
        KVCacheSDKError: The entry or a kernel group lacks a field or has an
            ill-typed one (the message names it).

    """
    out: list[EngineGroupInfo] = []
    for i, kg in enumerate(kernel_groups_of(entry)):
        where = f"entry.kv_cache_layout.kernel_groups[{i}]"
        engine_group_id = check_int(kg.get("engine_group_idx", 0), f"{where}.engine_group_idx")
        layers = check_int_list(kg.get("layer_indices"), f"{where}.layer_indices")
        tokens_per_block = check_int(kg.get("tokens_per_block", 0), f"{where}.tokens_per_block")
        out.append(
            EngineGroupInfo(
                engine_group_id=engine_group_id,
                layer_indices=layers,
                tokens_per_block=tokens_per_block,
            )
        )
    return out
