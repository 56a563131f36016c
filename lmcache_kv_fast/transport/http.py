"""HTTP info-plane client (docs/protocol.md §5): ``/config``, ``/status``, ``/version``.

Uses the standard library's ``http.client`` directly (no proxy, no redirect). Every call
has a total deadline (its ``timeout``), not only a per-read one: the socket's timeout is
re-armed to the time left before every send and receive, so a peer that drip-feeds its
reply one byte at a time cannot hold a call longer than ``timeout``.

A reply is decoded as JSON at most ``MAX_INFO_BYTES`` long; a document nested deeper
than Python's recursion limit is a :class:`~lmcache_kv_fast.errors.ProtocolError`.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import time
from typing import Any

from lmcache_kv_fast.errors import (
    AuthenticationError,
    KVCacheSDKError,
    ProtocolError,
    ServerTimeoutError,
)
from lmcache_kv_fast.transport.api_key import HOW_TO_PASS, ApiKey, resolve_api_key
from lmcache_kv_fast.transport.urls import Endpoint, parse_http_url

logger = logging.getLogger(__name__)

#: Refuse absurd info replies (a hostile or broken peer); real ones are a few KiB.
MAX_INFO_BYTES = 16 * 1024 * 1024


class _Deadline:
    """Arms the socket's timeout to the time left before every I/O call (a mixin)."""

    deadline = float("inf")

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self.settimeout(min(left, 3600.0))  # type: ignore[attr-defined]

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return super().recv(*args)  # type: ignore[misc]

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return super().recv_into(*args)  # type: ignore[misc]

    def send(self, *args: Any) -> int:
        self._arm()
        return super().send(*args)  # type: ignore[misc]

    def sendall(self, *args: Any) -> None:
        self._arm()
        return super().sendall(*args)  # type: ignore[misc]


class _DeadlineSocket(_Deadline, socket.socket):
    """A TCP socket whose every I/O call ends by the deadline."""


class _DeadlineSSLSocket(_Deadline, ssl.SSLSocket):
    """A TLS socket whose every I/O call ends by the deadline."""


def _open_socket(host: str, port: int, deadline: float) -> socket.socket:
    """Connect to ``host:port`` (every address it resolves to, in order) by ``deadline``."""
    err: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = _DeadlineSocket(family, kind, proto)
        sock.deadline = deadline
        try:
            sock._arm()
            sock.connect(addr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            err = e
            sock.close()
    raise err if err is not None else OSError(f"{host!r} resolves to no address")


class _Connection(http.client.HTTPConnection):
    """An HTTP connection whose socket ends every I/O call by ``deadline``."""

    def __init__(self, ep: Endpoint, deadline: float) -> None:
        super().__init__(ep.host, ep.port)
        self._deadline = deadline

    def connect(self) -> None:
        self.sock = _open_socket(self.host, self.port, self._deadline)


class _TLSConnection(http.client.HTTPSConnection):
    """An HTTPS connection whose socket ends every I/O call by ``deadline``."""

    def __init__(self, ep: Endpoint, deadline: float) -> None:
        tls = ssl.create_default_context()
        tls.sslsocket_class = _DeadlineSSLSocket
        super().__init__(ep.host, ep.port, context=tls)
        self._tls = tls
        self._deadline = deadline

    def connect(self) -> None:
        plain = _open_socket(self.host, self.port, self._deadline)
        try:
            plain._arm()  # the handshake runs with the time left as its timeout
            sock = self._tls.wrap_socket(plain, server_hostname=self.host)
        except BaseException:
            plain.close()
            raise
        sock.deadline = self._deadline  # type: ignore[attr-defined]
        self.sock = sock


class HttpInfoClient:
    """GET/POST JSON on the server's HTTP info plane.

    Args:
        base_url: e.g. ``http://127.0.0.1:8080`` (no path).
        timeout: Seconds a whole request may take (connect, send, headers and body).
        api_key: The server's API key, sent with every request (None: read
            ``LMCACHE_API_KEY`` / ``LMCACHE_API_KEY_FILE``; no key when neither is set).

    Raises:
        InvalidArgumentError: ``base_url`` is not an HTTP URL (``transport/urls.py``), or
            the key is not one line.
    """

    def __init__(self, base_url: str, timeout: float,
                 api_key: str | ApiKey | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._ep = parse_http_url(self.base_url, "http_url")
        self.api_key = resolve_api_key(api_key)

    def _request(self, method: str, path: str, body: Any = None, *,
                 missing_ok: bool = False, timeout: float | None = None) -> Any:
        url = f"{self.base_url}{path}"
        budget = timeout or self.timeout
        deadline = time.monotonic() + budget
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = self.api_key.header()
        if data is not None:
            headers["Content-Type"] = "application/json"
        cls = _TLSConnection if self._ep.scheme == "https" else _Connection
        conn = cls(self._ep, deadline)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            status = resp.status
            raw = resp.read(MAX_INFO_BYTES + 1)
        except TimeoutError as err:
            raise ServerTimeoutError(
                f"{method} {url} did not answer within {budget:g}s (the whole reply must "
                "arrive in that time). Is the LMCache server's HTTP API healthy?"
            ) from err
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise KVCacheSDKError(
                f"{method} {url} failed: {err!r:.200}. Is the LMCache server running with "
                "its HTTP API on that address (--http-host/--http-port)?"
            ) from err
        finally:
            conn.close()
        if missing_ok and status == 404:
            return None
        if status == 401:
            raise self._refused(method, url)
        if not 200 <= status < 300:
            raise KVCacheSDKError(f"{method} {url} answered HTTP {status}: {raw[:2000]!r}")
        if len(raw) > MAX_INFO_BYTES:
            raise ProtocolError(f"{method} {url} returned more than {MAX_INFO_BYTES} bytes")
        return decode_json(raw, f"{method} {url}")

    def _refused(self, method: str, url: str) -> AuthenticationError:
        if self.api_key is None:
            return AuthenticationError(
                f"{method} {url} answered HTTP 401: the LMCache server requires an API key "
                f"and none was given; {HOW_TO_PASS}"
            )
        return AuthenticationError(
            f"{method} {url} answered HTTP 401: the server refused the API key from "
            f"{self.api_key.source} (wrong or revoked key; the key is not shown); "
            f"{HOW_TO_PASS}"
        )

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


def decode_json(raw: bytes, what: str) -> Any:
    """Decode a JSON reply of a peer.

    Raises:
        ProtocolError: Not JSON, or nested deeper than Python's recursion limit.
    """
    try:
        return json.loads(raw)
    except RecursionError:
        raise ProtocolError(f"{what} returned JSON nested too deeply to decode") from None
    except ValueError as err:
        raise ProtocolError(f"{what} did not return JSON: {raw[:200]!r}") from err
