"""msgspec types of every payload and response the SDK exchanges (docs/protocol.md §4).

All travel as msgpack maps keyed by field name, fields in declaration order. Response
types are decoded strictly: a reply that does not fit is a protocol error, never a guess.
"""

from __future__ import annotations

import msgspec


class IPCCacheServerKey(msgspec.Struct, kw_only=True):
    """Cache key of one operation (docs/protocol.md §4.1); all ten fields are always sent."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: list[int]
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict | None = None
    num_kv_readers: int = 1


class PackedTokensKey(msgspec.Struct, kw_only=True):
    """0.5.7's cache key: the tokens as ``token_bytes``, big-endian uint32 each (§4.1)."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_bytes: bytes
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict | None = None
    num_kv_readers: int = 1


#: A key of either dialect (``Generation.token_bytes_keys`` picks one).
CacheKey = IPCCacheServerKey | PackedTokensKey


class RegisterEngineDrivenContextPayload(msgspec.Struct, kw_only=True):
    """Payload of ``register_kv_cache_engine_driven_context`` (docs/protocol.md §4.2)."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None = None


class RegisterEngineDrivenContextResponse(msgspec.Struct, kw_only=True):
    """Registration reply: the SHM pool name and size, or ``""``/0 for pickle (docs/protocol.md §3.1)."""

    shm_name: str = ""
    pool_size: int = 0
    null_block_id: int = 0  # 0.5.7; single-group clients ignore it


class Slot(msgspec.Struct, kw_only=True):
    """One L1 memory object in the SHM pool (docs/protocol.md §4.3, §7.2)."""

    offset: int
    length: int
    shape: list[int]
    dtype: str


class PrepareStoreContext(msgspec.Struct, kw_only=True):
    """``context`` of a prepare_store reply: empty on a pickle server."""

    slots: list[Slot] = []
    chunk_indices: list[int] = []


class PrepareStoreResponse(msgspec.Struct, kw_only=True):
    """Reply of ``prepare_store`` (docs/protocol.md §4.3)."""

    context: PrepareStoreContext = msgspec.field(default_factory=PrepareStoreContext)


class PrepareRetrieveContext(msgspec.Struct, kw_only=True):
    """``context`` of a prepare_retrieve reply: slots on SHM, empty on pickle/miss."""

    slots: list[Slot] = []


class PrepareRetrieveResponse(msgspec.Struct, kw_only=True):
    """Reply of ``prepare_retrieve`` (docs/protocol.md §4.4)."""

    success: bool
    #: pickle bytes on the pickle plane; a zero-copy view of the received frame
    data: memoryview = msgspec.field(default_factory=lambda: memoryview(b""))
    context: PrepareRetrieveContext = msgspec.field(default_factory=PrepareRetrieveContext)


class KVEventRecord(msgspec.Struct, kw_only=True):
    """One KV event record of the MP server (docs/protocol.md §4.5)."""

    seq: int
    kind: str
    medium: str = "CPU"
    model_name: str = ""
    block_hashes: list[bytes] = []
    parent_block_hash: bytes | None = None
    token_ids: list[int] = []


class WireKVEventBatch(msgspec.Struct, kw_only=True):
    """One batch of the KV event stream as the server sends it (docs/protocol.md §4.5, §9).

    Subscriptions yield :class:`lmcache_kv_fast.events.KVEventBatch`, this record plus
    what the client adds (``incarnation_changed``).
    """

    enabled: bool
    incarnation: int
    next_cursor: int
    lost: bool = False
    events: list[KVEventRecord] = []


class EngineGroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Engine KV-cache group (docs/protocol.md §4.6); sent with ``register_kv_cache``."""

    engine_group_id: int
    layer_indices: tuple[int, ...] = ()
    tokens_per_block: int = 0
    sw_size_tokens: int = -1
    extra_object_group_tag: int = 0
    recurrent_state: bool = False
