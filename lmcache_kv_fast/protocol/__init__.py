"""Wire protocol of the LMCache MP server: operation tables, payload types, codec.

Pure data, no I/O. Every protocol constant of the SDK lives in this package.
"""

from lmcache_kv_fast.protocol.constants import (
    CHUNK_HASH_NONE_SEED,
    MAX_CACHE_SALT_LEN,
    MAX_TOKEN_ID,
    SHM_POOL_PREFIX,
)
from lmcache_kv_fast.protocol.ops import GENERATIONS, Generation, Op, generation_for
from lmcache_kv_fast.protocol.types import (
    EngineGroupInfo,
    IPCCacheServerKey,
    KVEventRecord,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
    Slot,
    WireKVEventBatch,
)

__all__ = [
    "CHUNK_HASH_NONE_SEED",
    "GENERATIONS",
    "MAX_CACHE_SALT_LEN",
    "MAX_TOKEN_ID",
    "SHM_POOL_PREFIX",
    "EngineGroupInfo",
    "Generation",
    "IPCCacheServerKey",
    "KVEventRecord",
    "Op",
    "PrepareRetrieveResponse",
    "PrepareStoreResponse",
    "RegisterEngineDrivenContextPayload",
    "RegisterEngineDrivenContextResponse",
    "Slot",
    "WireKVEventBatch",
    "generation_for",
]
