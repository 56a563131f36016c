"""A TCP proxy in front of a real HTTP server that delays its replies (tests only).

The client's bytes go to the server at once; the server's bytes wait ``delay`` seconds
(all of them, or only the body with ``hold="body"``: the response head passes at once).
A client that gives up and disconnects does not abort the server's request: the proxy
keeps reading the server's reply until the response ends (``[DONE]`` of a server-sent
event stream, or the server closes), so the engine behind it runs every request to its
end. (vLLM 0.32 with LMCacheMPConnector can lose its EngineCore when a request is aborted
while a KV transfer is in flight -- LMCache issues #4185 and #4938 -- so a test of the
hooks' timeouts must not abort requests of the shared engine.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

_HEAD_END = b"\r\n\r\n"
_END_MARKERS = (b"[DONE]", b"\r\n0\r\n\r\n")


class HttpDelayProxy:
    """Forward connections to ``host:port``; hold the replies.

    Args:
        host: The server's host.
        port: The server's port.
        delay: Seconds the reply is held.
        hold: ``"all"`` (the whole reply) or ``"body"`` (after the response head).
    """

    def __init__(self, host: str, port: int, delay: float, hold: str = "all") -> None:
        if hold not in ("all", "body"):
            raise ValueError(f"hold must be 'all' or 'body', got {hold!r}")
        self._target = (host, port)
        self._delay = float(delay)
        self._hold = hold
        self._listen = socket.create_server(("127.0.0.1", 0))
        self._listen.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listen.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.finished = 0  # replies read to their end from the server
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._run, name="http-delay-proxy", daemon=True)
        self._accept.start()

    def close(self) -> None:
        """Stop accepting; wait for the connections' threads (each ends with its reply)."""
        self._stop.set()
        self._accept.join(5)
        for t in list(self._threads):
            t.join(30)
        self._listen.close()

    def __enter__(self) -> HttpDelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listen.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self._target, timeout=30)
        up = threading.Thread(target=self._client_to_server, args=(client, upstream), daemon=True)
        up.start()
        try:
            self._server_to_client(upstream, client)
        finally:
            with contextlib.suppress(OSError):
                client.close()
            with contextlib.suppress(OSError):
                upstream.close()
            up.join(5)

    @staticmethod
    def _client_to_server(client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                upstream.sendall(data)

    def _server_to_client(self, upstream: socket.socket, client: socket.socket) -> None:
        seen = b""
        release_at: float | None = None
        held = b""
        client_gone = False
        while True:
            try:
                data = upstream.recv(65536)
            except OSError:
                return
            if not data:
                break
            seen = (seen + data)[-64:]
            if release_at is None:
                release_at = time.monotonic() + self._delay
                if self._hold == "body" and _HEAD_END in data:
                    head, _, rest = data.partition(_HEAD_END)
                    client_gone = not _send(client, head + _HEAD_END)
                    data = rest
            held += data
            if time.monotonic() >= release_at and not client_gone:
                client_gone = not _send(client, held)
                held = b""
            if any(m in seen for m in _END_MARKERS):
                break
        if held and not client_gone and release_at is not None:
            time.sleep(max(0.0, release_at - time.monotonic()))
            _send(client, held)
        with self._lock:
            self.finished += 1


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False
