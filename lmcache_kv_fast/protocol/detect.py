"""Server generation detection (docs/protocol.md Appendix C). Pure functions of HTTP replies."""

from __future__ import annotations

from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.protocol.ops import (
    GEN_051,
    GEN_053,
    GEN_055,
    GEN_056,
    GEN_057,
    NEWEST,
    Generation,
    generation_for,
    known_versions,
    parse_version,
)

# `GET /config` "mp" keys, observed on the real servers (tests/unit/test_generations.py
# keeps the full sets). The keys are the server's config-dataclass fields: the same for
# every command line of one version.
#: Keys every generation has (0.5.1 / 0.5.2 have exactly these 18).
MP_KEYS_051 = frozenset({
    "chunk_size", "enable_segmented_prefix", "engine_type", "hash_algorithm", "host",
    "instance_id", "max_cpu_workers", "max_gpu_workers", "max_workers", "p2p_config", "port",
    "runtime_plugin_config", "script_allowed_imports", "separate_object_groups", "shm_name",
    "supported_transfer_mode", "worker_reap_timeout_seconds",
    "worker_registration_grace_seconds",
})
#: 0.5.3 / 0.5.4 add "enable".
MP_MARKERS_053 = frozenset({"enable"})
#: 0.5.5 adds these (0.5.6 keeps them).
MP_MARKERS_055 = frozenset({"enable_dedup_content", "isolated_ipc", "transport"})
#: 0.5.6 adds these.
MP_MARKERS_056 = frozenset({
    "enable_blend_reorder", "grpc_server_workers", "kv_event_log_size", "null_block_id",
    "run_script_api_enabled", "server_modules", "session_ttl_seconds",
})
#: Every key of 0.5.6.
MP_KEYS_056 = MP_KEYS_051 | MP_MARKERS_053 | MP_MARKERS_055 | MP_MARKERS_056
#: 0.5.7 drops "enable" and adds these.
MP_MARKERS_057 = frozenset({"api_key_files", "grpc_server_mode", "kv_load_policy"})
#: Every key of 0.5.7; more than these means a newer, unknown generation.
MP_KEYS_057 = (MP_KEYS_056 - MP_MARKERS_053) | MP_MARKERS_057


def detect_generation(version: str | None, mp_config: dict[str, Any]) -> tuple[Generation, bool]:
    """Pick the wire dialect of a server.

    ``GET /version`` decides when it answers with a version (every server 0.5.1 .. 0.5.7
    has it; ``"0.5.7rc2-gbf85b41f"`` is 0.5.7); otherwise the key set of ``/config``'s ``mp`` object does.

    Args:
        version: ``GET /version`` (None when the endpoint does not answer).
        mp_config: The ``mp`` object of ``GET /config``.

    Returns:
        ``(generation, needs_verification)``; the flag is True when the server is newer
        than every known generation and the newest table is being tried (verify it with a
        ``noop`` round trip before anything else).

    Raises:
        KVCacheSDKError: The generation cannot be recognised (the message names what was
            seen).
    """
    parsed = parse_version(version) if version is not None else None
    if parsed is not None:
        gen = generation_for(version)  # type: ignore[arg-type]
        if gen is not None:
            return gen, False
        newest = max(parse_version(v) or (0,) for v in NEWEST.versions)
        if parsed > newest:
            return NEWEST, True
        raise KVCacheSDKError(
            f"unsupported LMCache server version {version!r}: this SDK speaks "
            f"{known_versions()} (and tries the {NEWEST.name} dialect on newer servers)"
        )
    keys = set(mp_config)
    if keys & MP_MARKERS_057:
        return (NEWEST, True) if keys - MP_KEYS_057 else (GEN_057, False)
    if keys & MP_MARKERS_056:
        return (NEWEST, True) if keys - MP_KEYS_056 else (GEN_056, False)
    if keys & MP_MARKERS_055:
        return GEN_055, False
    if keys & MP_MARKERS_053:
        return GEN_053, False
    if keys >= MP_KEYS_051:
        return GEN_051, False
    seen = "no /version" if version is None else f"/version {version!r:.60}"
    raise KVCacheSDKError(
        f"cannot tell the LMCache server generation: {seen}, and /config.mp has keys "
        f"{sorted(keys)[:40]} (expected the keys of an LMCache MP server {known_versions()})"
    )
