"""What decoding a ``/status`` entry gives: per-group geometry and the chunk object.

:class:`DecodedGroup` (one kernel group), :class:`ChunkObject` (the object the SDK
registers and moves, docs/protocol.md §6.3) and :class:`DecodedEntry` (one rank of one
model), made by :mod:`lmcache_kv_fast.layout.decode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_kv_fast.errors import KVCacheSDKError

__all__ = ["ChunkObject", "DecodedEntry", "DecodedGroup", "format_layer_indices"]


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
