"""What the handshake and the background thread need of a session (typing only).

:class:`~lmcache_kv_fast.client.session.Session` has these members; the modules it uses
(``handshake``, ``liveness``) are typed against this protocol instead of importing the
session, so the arrows point one way: ``session`` → ``handshake`` / ``liveness`` → ``state``.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from lmcache_kv_fast.client.late import LateReplies
from lmcache_kv_fast.copy import ChunkGeometry
from lmcache_kv_fast.dataplane.shm import ShmPlane
from lmcache_kv_fast.layout import CpuEngineKV, KVLayout
from lmcache_kv_fast.protocol.ops import Generation
from lmcache_kv_fast.protocol.types import RegisterEngineDrivenContextPayload
from lmcache_kv_fast.transport.api_key import ApiKey
from lmcache_kv_fast.transport.releases import DeferredReleases
from lmcache_kv_fast.transport.zmq_client import ZmqClient

if TYPE_CHECKING:
    from lmcache_kv_fast.transport.grpc_client import GrpcClient


class SessionState(Protocol):
    """The session's fields the handshake fills and the background thread reads."""

    url: str
    http_url: str
    api_key: ApiKey | None
    model_name: str
    timeout: float
    instance_id: int
    writer_id: int
    writer_registered: bool
    writer_payload: RegisterEngineDrivenContextPayload | None
    reap_timeout_s: float
    registration_grace_s: float
    write_ttl_s: float
    read_ttl_s: float
    late: LateReplies
    backend: ModuleType
    zmq: ZmqClient | GrpcClient | None  # the control plane (named zmq before gRPC)
    shm: ShmPlane | None
    registered: bool
    releases: DeferredReleases | None
    chunk_size: int
    fifo_normal_pool: bool
    align: int
    generation: Generation
    server_version: str
    layout: KVLayout
    world_size: int
    geom: ChunkGeometry
    transport: str
    engine_kv: CpuEngineKV | None
    token_layout: KVLayout | None
    #: Per calling thread: the call's request_configs, timings, per-token converter.
    tls: threading.local

    def engine_copy(self) -> Any:
        """A CPU engine's per-token chunk converter (``client/engine_kv.EngineKVCopy``) or None."""

    def setup_geometry(self) -> None:
        """Derive the chunk geometry from ``layout`` and ``world_size``."""

    def teardown(self, drained: bool = True) -> None:
        """Undo what the handshake set up."""
