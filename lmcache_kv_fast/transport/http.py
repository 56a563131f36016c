"""HTTP info-plane client (docs/protocol.md §5): ``/config``, ``/status``, ``/version``.

Uses the standard library (no import cost beyond ``urllib``); every request has a timeout.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError

logger = logging.getLogger(__name__)

#: Refuse absurd info replies (a hostile or broken peer); real ones are a few KiB.
MAX_INFO_BYTES = 16 * 1024 * 1024


class HttpInfoClient:
    """GET/POST JSON on the server's HTTP info plane.

    Args:
        base_url: e.g. ``http://127.0.0.1:8080`` (no trailing path).
        timeout: Seconds per request.
    """

    def __init__(self, base_url: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _request(self, method: str, path: str, body: Any = None, *,
                 missing_ok: bool = False, timeout: float | None = None) -> Any:
        url = f"{self.base_url}{path}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                raw = resp.read(MAX_INFO_BYTES + 1)
        except urllib.error.HTTPError as err:
            if missing_ok and err.code == 404:
                return None
            raise KVCacheSDKError(
                f"{method} {url} answered HTTP {err.code}: {err.read(2000)!r}"
            ) from err
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise KVCacheSDKError(
                f"{method} {url} failed: {reason}. Is the LMCache server running with its "
                "HTTP API on that address (--http-host/--http-port)?"
            ) from err
        if len(raw) > MAX_INFO_BYTES:
            raise ProtocolError(f"{method} {url} returned more than {MAX_INFO_BYTES} bytes")
        try:
            return json.loads(raw)
        except ValueError as err:
            raise ProtocolError(f"{method} {url} did not return JSON: {raw[:200]!r}") from err

    def get(self, path: str, *, missing_ok: bool = False, timeout: float | None = None) -> Any:
        """GET ``path`` and decode its JSON (None for a 404 when ``missing_ok``)."""
        return self._request("GET", path, missing_ok=missing_ok, timeout=timeout)

    def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """POST a JSON body to ``path`` and decode the JSON reply."""
        return self._request("POST", path, body, timeout=timeout)

    def config(self) -> dict[str, Any]:
        """Return ``GET /config`` (must be a JSON object with an ``mp`` object)."""
        cfg = self.get("/config")
        if not isinstance(cfg, dict) or not isinstance(cfg.get("mp"), dict):
            raise ProtocolError(
                f"GET {self.base_url}/config: expected a JSON object with an 'mp' object, "
                f"got {type(cfg).__name__} with keys {sorted(cfg)[:10] if isinstance(cfg, dict) else '-'}"
            )
        return cfg

    def status(self) -> dict[str, Any]:
        """Return ``GET /status`` (must be a JSON object)."""
        st = self.get("/status")
        if not isinstance(st, dict):
            raise ProtocolError(
                f"GET {self.base_url}/status: expected a JSON object, got {type(st).__name__}"
            )
        return st

    def version(self) -> str | None:
        """Return ``GET /version`` (0.5.6+) or None when the server has no such endpoint."""
        v = self.get("/version", missing_ok=True)
        if v is None:
            return None
        if not isinstance(v, str):
            raise ProtocolError(f"GET {self.base_url}/version: expected a string, got {v!r:.80}")
        return v

    def clear_cache(self, force: bool = False) -> Any:
        """``POST /cache/clear`` of L1."""
        return self.post("/cache/clear", {"tier": "l1", "force": force})
