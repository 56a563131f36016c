"""Server generation detection (protocol doc Appendix C). Pure functions of HTTP replies."""

from __future__ import annotations

from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.protocol.ops import (
    GEN_051,
    GEN_053,
    GEN_055,
    NEWEST,
    Generation,
    generation_for,
    parse_version,
)


def detect_generation(version: str | None, mp_config: dict[str, Any]) -> tuple[Generation, bool]:
    """Pick the wire dialect of a server.

    Args:
        version: ``GET /version`` (None when the endpoint does not exist, before 0.5.6).
        mp_config: The ``mp`` object of ``GET /config``.

    Returns:
        ``(generation, needs_verification)``; the flag is True when the server is newer
        than every known generation and the newest table is being tried.

    Raises:
        KVCacheSDKError: The generation cannot be recognised.
    """
    if version is not None:
        gen = generation_for(version)
        if gen is not None:
            return gen, False
        parsed = parse_version(version)
        newest = max(parse_version(v) or (0,) for v in NEWEST.versions)
        if parsed is not None and parsed > newest:
            return NEWEST, True
        raise KVCacheSDKError(
            f"unsupported LMCache server version {version!r}: this SDK speaks "
            "0.5.1 .. 0.5.6 (and tries the 0.5.6 dialect on newer servers)"
        )
    keys = set(mp_config)
    if "transport" in keys:
        return GEN_055, False
    if "enable" in keys:
        return GEN_053, False
    if "chunk_size" in keys and len(keys) <= 20:
        return GEN_051, False
    raise KVCacheSDKError(
        "cannot tell the LMCache server generation: no /version endpoint and /config.mp "
        f"has keys {sorted(keys)[:25]}"
    )
