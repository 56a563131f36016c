"""KV-cache layouts: the EngineKVFormat table, ``/status`` decoding, ``KVLayout``, engine groups.

* :mod:`~lmcache_kv_fast.layout.formats` — the 19 engine KV formats as one table.
* :mod:`~lmcache_kv_fast.layout.decode` — parse ``cache_context_meta`` entries into
  per-group geometry and the chunk object the SDK registers (docs/protocol.md §5.2, §6).
* :mod:`~lmcache_kv_fast.layout.kvlayout` — :class:`KVLayout`, the whole-model
  geometry the user works with.
* :mod:`~lmcache_kv_fast.layout.engine_groups` — engine-group helpers (§4.6).

Pure data and arithmetic, no I/O; ``lmcache`` is never imported.
"""

from lmcache_kv_fast.layout.decode import (
    ChunkObject,
    DecodedEntry,
    DecodedGroup,
    decode_kernel_group,
    decode_status_entry,
    find_model_entries,
    parse_concrete_shape,
)
from lmcache_kv_fast.layout.engine_groups import (
    EXCLUDED_ENGINE_GROUP,
    EngineGroupInfo,
    engine_group_layer_indices,
    expand_engine_block_ids,
    get_engine_group_indices,
    groups_from_status_entry,
    num_engine_group_infos,
    num_engine_groups,
    slice_block_ids_per_group,
)
from lmcache_kv_fast.layout.formats import FORMATS, EngineKVFormat, FormatSpec, get_format
from lmcache_kv_fast.layout.kvlayout import SUPPORTED_DTYPES, KVLayout, normalize_dtype

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "FORMATS",
    "SUPPORTED_DTYPES",
    "ChunkObject",
    "DecodedEntry",
    "DecodedGroup",
    "EngineGroupInfo",
    "EngineKVFormat",
    "FormatSpec",
    "KVLayout",
    "decode_kernel_group",
    "decode_status_entry",
    "engine_group_layer_indices",
    "expand_engine_block_ids",
    "find_model_entries",
    "get_engine_group_indices",
    "get_format",
    "groups_from_status_entry",
    "normalize_dtype",
    "num_engine_group_infos",
    "num_engine_groups",
    "parse_concrete_shape",
    "slice_block_ids_per_group",
]
