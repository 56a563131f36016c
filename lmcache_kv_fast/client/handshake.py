"""Connecting a session: ``/config``, ``/version``, ``noop``, ``/status``, registration.

:func:`handshake` checks that the server can serve this SDK (transfer mode, transport,
wire dialect), finds the model's KV layout (the vLLM registration in ``/status``, or the
caller's explicit one, checked against it), registers the engine-driven reader instance
and, on the SHM plane, the writer instance (``client/session.py`` says why two), and maps
the server's SHM pool when it offers one (else the pickle plane is used).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from lmcache_kv_fast.client.engine_kv import EngineOptions
from lmcache_kv_fast.client.engine_kv import resolve_layout as resolve_engine_layout
from lmcache_kv_fast.client.instances import release_instance_id
from lmcache_kv_fast.client.state import SessionState
from lmcache_kv_fast.dataplane.shm import ShmPlane
from lmcache_kv_fast.errors import (
    InvalidTypeError,
    KVCacheSDKError,
    ProtocolError,
    ServerError,
    ServerTimeoutError,
    UnsupportedServerError,
)
from lmcache_kv_fast.layout import KVLayout, decode_status_entry, find_model_entries
from lmcache_kv_fast.protocol.constants import DEFAULT_ALIGN_BYTES
from lmcache_kv_fast.protocol.detect import detect_generation
from lmcache_kv_fast.protocol.keys import make_key
from lmcache_kv_fast.protocol.mp_config import (
    live_chunk_size,
    mp_chunk_size,
    require_transport,
)
from lmcache_kv_fast.protocol.ops import Op, known_versions
from lmcache_kv_fast.protocol.types import (
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
)
from lmcache_kv_fast.transport import control_transport, open_control
from lmcache_kv_fast.transport.http import HttpInfoClient

logger = logging.getLogger(__name__)

#: connect() probes give up after this long for an unreachable peer.
CONNECT_PROBE_TIMEOUT_S = 5.0
#: A newer server's dialect check waits this long (the HTTP and noop probes came first).
DIALECT_PROBE_TIMEOUT_S = 2.0
#: The writer's registration grace must outlast its reservations' write TTL by this much
#: for a dead client's unfilled reservation never to be admitted (docs/guarantees.md).
GRACE_MARGIN_S = 10.0

_warned_servers: set[str] = set()
_warned_lock = threading.Lock()


def handshake(s: SessionState, layout: KVLayout | None, world_size: int | None,
              engine: EngineOptions | None = None) -> None:
    """Connect ``s`` to its server and register it; fills the session's server fields.

    Without ``layout`` and without a vLLM registration of the model, the geometry of an
    engine-driven (CPU) engine is derived from ``/status`` and the model's configuration
    (``client/engine_kv.py``; ``engine``: connect's hints for that).

    The control-plane client (ZMQ or gRPC, from the URL), the registration and the SHM
    mapping are recorded on ``s`` as soon as they exist, so that ``s.teardown()`` undoes a
    handshake that failed half-way.

    Raises:
        KVCacheSDKError: The server cannot be used (see the message for why).
    """
    probe = min(s.timeout, CONNECT_PROBE_TIMEOUT_S)
    transport = control_transport(s.url)  # a gRPC URL without grpcio: MissingExtraError
    http = HttpInfoClient(s.http_url, probe, s.api_key)
    cfg = http.config()
    mp = cfg["mp"]
    s.chunk_size = mp_chunk_size(mp)
    mode = mp.get("supported_transfer_mode", "auto")
    if mode not in ("auto", "engine_driven"):
        raise KVCacheSDKError(
            f"the server at {s.http_url} runs with --supported-transfer-mode {mode}; "
            "the SDK needs 'auto' or 'engine_driven' (restart the server with "
            "--supported-transfer-mode auto)"
        )
    require_transport(mp, s.http_url, s.url, transport)
    version = http.version()
    gen, verify = detect_generation(version, mp)
    s.generation = gen
    s.server_version = version.strip('"') if version else f"{gen.name} (detected)"
    workers = mp.get("max_cpu_workers") or mp.get("max_workers") or 1
    # gRPC runs requests on its thread pool: no order, even with one worker
    s.fifo_normal_pool = workers == 1 and transport == "zmq"
    s.align = _align_from_config(cfg)
    _liveness_from_config(s, cfg)

    s.zmq = open_control(s.url, gen, s.timeout)
    try:
        reply = s.zmq.call(Op.NOOP, (), None, probe)
    except ServerTimeoutError as err:
        raise KVCacheSDKError(
            f"nothing answers noop on {s.url} within {probe:g}s (HTTP at "
            f"{s.http_url} does). Check the {transport.upper()} URL/port, or the server's "
            "request loop is dead (restart it)"
        ) from err
    if reply != "OK":
        raise _unsupported(s, version, f"noop answered {reply!r}, expected 'OK'") if verify \
            else KVCacheSDKError(f"noop on {s.url} answered {reply!r}, expected 'OK': the "
                                 f"server speaks another dialect than {gen.name}")
    if verify:
        _verify_dialect(s, version, probe)

    status = http.status()
    s.chunk_size = live_chunk_size(status, s.chunk_size)
    layout, ws = _find_layout(s, status, layout, world_size, engine or EngineOptions())
    s.layout = layout
    s.world_size = ws
    s.setup_geometry()
    _check_chunk_fits(s.geom.chunk_nbytes, _l1_bytes_from_config(cfg),
                      "the server's L1 (/config size_in_bytes)")
    _register(s)
    logger.info(
        "connected to LMCache %s at %s (model %s, %s plane, chunk %d, world_size %d, "
        "backend %s)", s.server_version, s.url, s.model_name, s.transport,
        s.chunk_size, ws, s.backend.NAME,
    )


def _verify_dialect(s: SessionState, version: str | None, probe: float) -> None:
    """Check the newest dialect on a server newer than every known one, with a keyed call.

    ``noop`` has no payload, so it cannot tell a changed key or signature; a
    ``free_lookup_locks`` of no tokens releases nothing and is answered by a server that
    decodes our key and payload count, and met with silence (the server's answer to a
    request it cannot decode) otherwise.

    Raises:
        UnsupportedServerError: No answer within ``probe`` seconds.
    """
    assert s.zmq is not None
    key = make_key(s.generation, model_name=s.model_name, world_size=1, worker_id=None,
                   tokens=[], start=0, end=0, request_id=f"kvf-probe-{s.instance_id:x}")
    try:
        s.zmq.call(Op.FREE_LOOKUP_LOCKS, [key, 1], None, min(probe, DIALECT_PROBE_TIMEOUT_S))
    except ServerTimeoutError:
        raise _unsupported(s, version, "a keyed request in that dialect got no reply") \
            from None
    except ServerError as err:  # gRPC: the server's decode error comes back as a status
        raise _unsupported(s, version, f"a keyed request in that dialect failed: {err}") \
            from None
    s.zmq.tried_dialect = f"{s.generation.name} dialect tried on newer server {version!r:.60}"
    logger.warning("LMCache server %s at %s is newer than this SDK knows (%s); its %s "
                   "dialect answered a keyed probe and is used", version, s.http_url,
                   known_versions(), s.generation.name)


def _unsupported(s: SessionState, version: str | None, what: str) -> UnsupportedServerError:
    return UnsupportedServerError(
        f"the LMCache server at {s.http_url} is version {version or '(unknown)'!s:.60}, "
        f"newer than this SDK knows (it speaks {known_versions()}): the newest dialect "
        f"({s.generation.name}) was tried and {what}. Upgrade lmcache-kv-fast, or run a "
        f"server of {known_versions()}"
    )


def _find_layout(s: SessionState, status: dict[str, Any], layout: KVLayout | None,
                 world_size: int | None, engine: EngineOptions) -> tuple[KVLayout, int]:
    """The model's layout and world size.

    From the vLLM registration in ``/status``, or the explicit ones checked against it, or
    (neither) an engine-driven engine's registration plus the model's configuration.
    """
    entries = find_model_entries(status, s.model_name)
    if layout is not None:
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(
                f"layout must be a KVLayout, got {type(layout).__name__}"
            )
        ws = 1 if world_size is None else world_size
        if entries:
            decoded = decode_status_entry(entries[0][1], s.chunk_size)
            decoded.require_single_group()
            theirs = KVLayout.from_decoded(decoded)
            diffs = layout.diff(theirs)
            if diffs or decoded.world_size != ws:
                if decoded.world_size != ws:
                    diffs.append(f"world_size: given {ws}, vLLM has {decoded.world_size}")
                raise KVCacheSDKError(
                    f"explicit layout for {s.model_name!r} disagrees with the vLLM "
                    f"registration on the server: {'; '.join(diffs)}"
                )
        return layout, ws
    if not entries:
        known = sorted({e.get("model_name", "?") for e in
                        (status.get("cache_context_meta") or {}).values()
                        if isinstance(e, dict)})
        return resolve_engine_layout(
            s, status, world_size, engine,
            f"no registered KV layout for model {s.model_name!r} on {s.http_url}: no vLLM "
            f"registration (models with one: {known or 'none'})")
    decoded = decode_status_entry(entries[0][1], s.chunk_size)
    decoded.require_single_group()
    layout = KVLayout.from_decoded(decoded)
    ws = decoded.world_size
    if world_size is not None and world_size != ws:
        raise KVCacheSDKError(
            f"world_size={world_size} given, but the vLLM registration of "
            f"{s.model_name!r} has world_size {ws}"
        )
    return layout, ws


def _register(s: SessionState) -> None:
    """Register the engine-driven context; map the SHM pool when the server has one."""
    assert s.zmq is not None
    layout = s.layout
    payload = RegisterEngineDrivenContextPayload(
        instance_id=s.instance_id,
        model_name=s.model_name,
        world_size=s.world_size,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        hidden_dim_size=s.geom.width,
        dtype_str=layout.dtype_str,
        use_mla=layout.planes == 1,
        num_physical_slots=s.chunk_size,
    )
    try:
        resp = s.zmq.call(Op.REGISTER_ENGINE_DRIVEN, [payload],
                          RegisterEngineDrivenContextResponse)
    except ServerTimeoutError as err:
        raise KVCacheSDKError(
            f"register_kv_cache_engine_driven_context on {s.url} got no reply: the "
            "server refused the registration (see its log) or engine-driven transfers "
            "are disabled (--supported-transfer-mode auto)"
        ) from err
    s.registered = True
    if resp.shm_name:
        s.shm = ShmPlane(s.backend, resp.shm_name, resp.pool_size, s.align)
        s.transport = "shm"
        _check_chunk_fits(s.geom.chunk_nbytes, resp.pool_size, "the server's SHM pool")
        _register_writer(s, payload)
    else:
        s.transport = "pickle"
        release_instance_id(s.writer_id)
        s.writer_id = s.instance_id  # nothing is reserved across calls: one registration


def _register_writer(s: SessionState, reader: RegisterEngineDrivenContextPayload) -> None:
    """Register the writer instance (SHM plane): stores only, never pinged."""
    assert s.zmq is not None
    payload = RegisterEngineDrivenContextPayload(**{
        f: getattr(reader, f) for f in reader.__struct_fields__})
    payload.instance_id = s.writer_id
    try:
        s.zmq.call(Op.REGISTER_ENGINE_DRIVEN, [payload], RegisterEngineDrivenContextResponse)
    except ServerTimeoutError as err:
        raise KVCacheSDKError(
            f"register_kv_cache_engine_driven_context (writer) on {s.url} got no reply: the "
            "server refused the registration (see its log)"
        ) from err
    s.writer_registered = True
    s.writer_payload = payload
    _check_crash_guarantee(s)


def _liveness_from_config(s: SessionState, cfg: dict[str, Any]) -> None:
    """Read the reaper and TTL settings (docs/protocol.md §3.11, §3.15); keep the defaults if absent."""
    mp = cfg["mp"]
    try:
        l1 = cfg["storage_manager"]["l1_manager_config"]
    except (KeyError, TypeError):
        l1 = {}
    for attr, where, name in (
        ("reap_timeout_s", mp, "worker_reap_timeout_seconds"),
        ("registration_grace_s", mp, "worker_registration_grace_seconds"),
        ("write_ttl_s", l1, "write_ttl_seconds"),
        ("read_ttl_s", l1, "read_ttl_seconds"),
    ):
        v = where.get(name) if isinstance(where, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9:
            setattr(s, attr, float(v))


def _check_crash_guarantee(s: SessionState) -> None:
    """Warn (once per server) when a dead client's reservation could be admitted."""
    if s.reap_timeout_s <= 0:
        return  # never reaped: the writer is only ever unregistered by close()
    if s.registration_grace_s >= s.write_ttl_s + GRACE_MARGIN_S:
        return
    with _warned_lock:
        if s.http_url in _warned_servers:
            return
        _warned_servers.add(s.http_url)
    logger.warning(
        "LMCache server at %s reaps a silent never-pinged instance after %gs "
        "(--worker-registration-grace-seconds) but store reservations live %gs "
        "(--l1-write-ttl-seconds): if a client dies between reserving and committing a "
        "store, the reaper may admit the unwritten slots as cached KV (docs/guarantees.md). "
        "Start the server with a grace above the write TTL + %gs to close that window",
        s.http_url, s.registration_grace_s, s.write_ttl_s, GRACE_MARGIN_S,
    )


def _l1_bytes_from_config(cfg: dict[str, Any]) -> Any:
    try:
        return cfg["storage_manager"]["l1_manager_config"]["memory_config"]["size_in_bytes"]
    except (KeyError, TypeError):
        return None


def _check_chunk_fits(chunk_nbytes: int, capacity: Any, what: str) -> None:
    """Refuse a geometry whose chunk object cannot fit the server (absurd or hostile sizes)."""
    if type(capacity) is int and capacity > 0 and chunk_nbytes > capacity:
        raise KVCacheSDKError(
            f"one chunk object of this model is {chunk_nbytes} bytes but {what} holds "
            f"{capacity} bytes: nothing could ever be stored (check the model geometry, "
            "--chunk-size and --l1-size-gb)"
        )


def _align_from_config(cfg: dict[str, Any]) -> int:
    try:
        a = cfg["storage_manager"]["l1_manager_config"]["memory_config"]["align_bytes"]
    except (KeyError, TypeError):
        return DEFAULT_ALIGN_BYTES
    if type(a) is not int or a <= 0 or a & (a - 1):
        raise ProtocolError(f"/config align_bytes: expected a power of two, got {a!r:.40}")
    return a
