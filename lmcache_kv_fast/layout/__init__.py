"""KV-cache layouts: the EngineKVFormat table, ``/status`` decoding, ``KVLayout``, engine groups.

* :mod:`~lmcache_kv_fast.layout.formats` — the 19 engine KV formats as one table.
* :mod:`~lmcache_kv_fast.layout.decode` — parse ``cache_context_meta`` entries into
  per-group geometry and the chunk object the SDK registers (docs/protocol.md §5.2, §6);
  its parts: :mod:`~lmcache_kv_fast.layout.status_fields` (checked ``/status`` field
  access), :mod:`~lmcache_kv_fast.layout.concrete_shape` (``engine_kv_concrete_shape``),
  :mod:`~lmcache_kv_fast.layout.decode_group` (one kernel group),
  :mod:`~lmcache_kv_fast.layout.decoded` (the decoded types).
* :mod:`~lmcache_kv_fast.layout.kvlayout` — :class:`KVLayout`, the whole-model
  geometry the user works with.
* :mod:`~lmcache_kv_fast.layout.engine_groups` — engine-group helpers (docs/protocol.md §4.6).
* :mod:`~lmcache_kv_fast.layout.hf_config` — KV geometry from a model's ``config.json``
  (:meth:`KVLayout.from_hf_config`).
* :mod:`~lmcache_kv_fast.layout.cpu_engine` — a CPU vLLM engine's raw KV rows <-> per-token
  K/V (:class:`CpuEngineKV`), per attention kernel.
* :mod:`~lmcache_kv_fast.layout.engine_resolve` — an engine-driven registration's layout
  from ``/status`` + the model configuration (:func:`resolve_engine_layout`).

Pure data and arithmetic; the only I/O is reading a model's ``config.json``; ``lmcache``
is never imported.
"""

from lmcache_kv_fast.layout.cpu_engine import (
    UNVERIFIED_KERNELS,
    VERIFIED_KERNELS,
    CpuEngineKV,
    UnsupportedEngineLayoutError,
    raw_rows_from_paged_blocks,
    select_cpu_kernel,
)
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
from lmcache_kv_fast.layout.engine_resolve import (
    EngineLayoutUnresolvedError,
    EngineResolution,
    resolve_engine_layout,
)
from lmcache_kv_fast.layout.formats import FORMATS, EngineKVFormat, FormatSpec, get_format
from lmcache_kv_fast.layout.hf_config import ModelConfigNotFoundError, load_hf_config
from lmcache_kv_fast.layout.kvlayout import (
    SUPPORTED_DTYPES,
    KVLayout,
    layout_from_hf_config,
    normalize_dtype,
)

__all__ = [
    "EXCLUDED_ENGINE_GROUP",
    "FORMATS",
    "SUPPORTED_DTYPES",
    "UNVERIFIED_KERNELS",
    "VERIFIED_KERNELS",
    "ChunkObject",
    "CpuEngineKV",
    "DecodedEntry",
    "DecodedGroup",
    "EngineGroupInfo",
    "EngineKVFormat",
    "EngineLayoutUnresolvedError",
    "EngineResolution",
    "FormatSpec",
    "KVLayout",
    "ModelConfigNotFoundError",
    "UnsupportedEngineLayoutError",
    "decode_kernel_group",
    "decode_status_entry",
    "engine_group_layer_indices",
    "expand_engine_block_ids",
    "find_model_entries",
    "get_engine_group_indices",
    "get_format",
    "groups_from_status_entry",
    "layout_from_hf_config",
    "load_hf_config",
    "normalize_dtype",
    "num_engine_group_infos",
    "num_engine_groups",
    "parse_concrete_shape",
    "raw_rows_from_paged_blocks",
    "resolve_engine_layout",
    "select_cpu_kernel",
    "slice_block_ids_per_group",
]
