"""Shared pieces of the fleet: a server's slot (its actor and state) and small helpers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from lmcache_kv_fast.distributed.servers import Server
from lmcache_kv_fast.protocol.detect import detect_generation
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.transport import open_control
from lmcache_kv_fast.transport.http import HttpInfoClient

logger = logging.getLogger("lmcache_kv_fast.distributed")

#: Seconds between two probes of an actor Ray is restarting.
PROBE_RETRY_S = 0.2


@dataclass
class Member:
    """One server's place in the fleet: its actor and what is known about it."""

    index: int
    server: Server
    node: str | None
    handle: Any = None
    state: str = "starting"  # starting | up | recovering | down
    gen: int = 0  # bumped on every loss: replies of an older generation are stale
    info: dict[str, Any] = field(default_factory=dict)
    lost_at: float = 0.0
    lost_instances: list[int] = field(default_factory=list)
    probe: Any = None
    probe_due: float = 0.0
    replacements: int = 0
    down_reason: str = ""
    in_flight: int = 0

    @property
    def write_ttl(self) -> float:
        """The server's store-slot write TTL (seconds)."""
        return float(self.info.get("write_ttl_seconds", 600.0))


def first_line(err: BaseException) -> str:
    """``Type: first line of the message`` (Ray errors carry long tracebacks)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def server_answers(server: Server, timeout: float = 3.0) -> bool:
    """True when the server's HTTP plane answers ``/status`` within ``timeout``."""
    from lmcache_kv_fast.transport.http import HttpInfoClient

    try:
        HttpInfoClient(server.http_url.rstrip("/"), timeout).status()
        return True
    except Exception:
        return False


def unregister_reader(server: Server, instance_id: int, api_key: Any = None,
                      timeout: float = 5.0) -> bool:
    """Unregister a lost actor's reader registration from the driver (best effort).

    An actor that died before closing leaves its context registered until the server reaps
    it. The reader only reads, so unregistering it frees its locks at once; the writer is
    left to the server's reaper, which never admits a reservation whose TTL is still running
    (docs/protocol.md §3.2). Returns whether the server acknowledged.
    """
    try:
        http = HttpInfoClient(server.http_url, timeout, api_key)
        gen, _ = detect_generation(http.version(), http.config()["mp"])
        client = open_control(server.url, gen, timeout)
        try:
            client.call(Op.UNREGISTER_ENGINE_DRIVEN, [int(instance_id)], None, timeout)
        finally:
            client.close()
        return True
    except Exception as err:  # the server may be gone too: its registrations went with it
        logger.debug("unregistering instance %s on %s: %s", instance_id, server.name, err)
        return False
