"""Protocol constants (docs/protocol.md §2, §4, §7, §8)."""

from __future__ import annotations

#: Prefix the server puts in front of the configured ``--shm-name`` (docs/protocol.md §5.1, §7.1).
SHM_POOL_PREFIX = "lmcache_l1_pool_"

#: Token ids are packed as big-endian uint32 by the server's hasher (docs/protocol.md §8.1).
MAX_TOKEN_ID = (1 << 32) - 1

#: ``cache_salt`` rules enforced by the server's key decoder (docs/protocol.md §4.1).
MAX_CACHE_SALT_LEN = 128
FORBIDDEN_SALT_CHARS = frozenset("@/\\\x00")

#: ``model_name`` must not contain this (ObjectKey separator, docs/protocol.md §4.1).
FORBIDDEN_MODEL_CHARS = frozenset("@")

#: Read locks a lookup takes per object for one SDK reader (docs/protocol.md §11 #13).
SDK_NUM_KV_READERS = 1

#: blake3 seed of the chunk-hash chain: int64_be(0) || uint32_be(0) (docs/protocol.md §8.1).
CHUNK_HASH_NONE_SEED = (0).to_bytes(8, "big", signed=True) + (0).to_bytes(4, "big")

#: Instance ids are random 63-bit integers (docs/protocol.md §4.2).
INSTANCE_ID_BITS = 63

#: Stream control frames (docs/protocol.md §2.6).
STREAM_ACK = b"ack"
STREAM_CANCEL = b"cancel"

#: ``subscribe_kv_events`` limits (docs/protocol.md §9).
MAX_EVENTS_PER_BATCH = 1024

#: Server-side reaper limits (docs/protocol.md §3.11).
DEFAULT_REAP_TIMEOUT_S = 120.0

#: Lower bound on the server's allocation alignment (docs/protocol.md §7.2, ``--l1-align-bytes``).
DEFAULT_ALIGN_BYTES = 4096

#: torch dtype names the server accepts in ``dtype_str`` and slot descriptors.
DTYPE_ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}

#: The 0.5.7 inline plane's msgpack ``TensorEnvelope`` (docs/protocol.md §7.6): its
#: version and the server's limits (per tensor, per payload, tensors, dimensions).
ENVELOPE_VERSION = 1
ENVELOPE_MAX_TENSOR_BYTES = 2 * 1024**3
ENVELOPE_MAX_TOTAL_BYTES = 16 * 1024**3
ENVELOPE_MAX_TENSORS = 65536
ENVELOPE_MAX_RANK = 16
