"""KV events of the LMCache MP server, SDK store announcements, and a vLLM-format publisher.

Three layers (docs/protocol.md §2.6, §9):

* :func:`subscribe` opens the server's credit-based ``subscribe_kv_events`` stream and
  returns a :class:`KVEventSubscription`, an iterator of typed :class:`KVEventBatch`
  objects (acked, pinged, resumed at the cursor; a server restart is surfaced as
  ``batch.incarnation_changed``).
* SDK stores announce themselves: :func:`announce_store` turns a store of this SDK into
  ``stored`` :class:`KVEventRecord` objects hashed like the server (blake3 chain) and hands
  them to in-process listeners (:func:`add_listener`, keyed by model name). The server
  itself records no ``stored`` event for engine-driven (SDK) stores (docs/protocol.md §11 #21).
* :class:`KVEventPublisher` republishes both sources in vLLM's KV-events wire format (ZMQ
  PUB plus vLLM's optional ROUTER replay socket) through a :class:`VllmEventMapper`.

Modules (arrows point one way: ``cli → publisher → {stream, announce, vllm_format}``):
:mod:`.common` (shared vocabulary), :mod:`.endpoint` (:class:`EventsEndpoint`, target
helpers), :mod:`.stream_io` (the subscription's wire half, :class:`KVEventBatch`),
:mod:`.keepalive` (the ping thread), :mod:`.stream` (:func:`subscribe`),
:mod:`.stream_grpc` (the gRPC subscription), :mod:`.announce` (listeners, hashing),
:mod:`.vllm_format` (vLLM structs, mapper), :mod:`.publisher`, :mod:`.cli` (loaded only
when :func:`events_main` runs). Nothing here imports ``lmcache``; ``blake3`` is needed only
for announcements (optional dependency).
"""

from __future__ import annotations

# Names marked F401 are importable from here as before the split but are not in __all__.
from lmcache_kv_fast.events.announce import (
    Listener,  # noqa: F401
    StoreAnnouncement,
    add_listener,
    announce_store,
    has_listeners,
    remove_listener,
    server_hash_algorithm,  # noqa: F401
)
from lmcache_kv_fast.events.common import (
    KIND_REMOVED,  # noqa: F401
    KIND_STORED,  # noqa: F401
    KV_EVENT_CAPABILITY,
    LOCAL_SEQ,
    MEDIUM_CPU,  # noqa: F401
)
from lmcache_kv_fast.events.endpoint import EventsEndpoint
from lmcache_kv_fast.events.publisher import (
    DEFAULT_BUFFER_STEPS,  # noqa: F401
    DEFAULT_HWM,  # noqa: F401
    DEFAULT_PUBLISH,
    DEFAULT_TOPIC,
    KVEventPublisher,
    PublishHook,  # noqa: F401
    VllmZmqPublisher,
)
from lmcache_kv_fast.events.stream import (
    DEFAULT_CLOSE_TIMEOUT_S,  # noqa: F401
    KVEventSubscription,
    subscribe,
)
from lmcache_kv_fast.events.stream_grpc import GrpcKVEventSubscription
from lmcache_kv_fast.events.stream_io import (
    KVEventBatch,
    KVEventTimeout,
    send_stream_control,  # noqa: F401
)
from lmcache_kv_fast.events.vllm_format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,  # noqa: F401
    VllmEvent,  # noqa: F401
    VllmEventMapper,
    VllmKVEventBatch,
    WireFormat,  # noqa: F401
    decode_vllm_batch,
    encode_vllm_batch,
)
from lmcache_kv_fast.hashing import chunk_hashes
from lmcache_kv_fast.protocol.constants import MAX_EVENTS_PER_BATCH  # noqa: F401
from lmcache_kv_fast.protocol.types import KVEventRecord

__all__ = [
    "DEFAULT_PUBLISH",
    "DEFAULT_TOPIC",
    "KV_EVENT_CAPABILITY",
    "LOCAL_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventsEndpoint",
    "GrpcKVEventSubscription",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventRecord",
    "KVEventSubscription",
    "KVEventTimeout",
    "StoreAnnouncement",
    "VllmEventMapper",
    "VllmKVEventBatch",
    "VllmZmqPublisher",
    "add_listener",
    "announce_store",
    "chunk_hashes",
    "decode_vllm_batch",
    "encode_vllm_batch",
    "events_main",
    "has_listeners",
    "remove_listener",
    "subscribe",
]

def events_main(argv: list[str]) -> int:
    """``lmcache-kv-fast events`` (see :func:`lmcache_kv_fast.events.command.events_main`).

    The command module is imported only here, when the command runs.
    """
    from lmcache_kv_fast.events.command import events_main as _main

    return _main(argv)
