"""An HTTP proxy in front of a real LMCache server that reports another version (tests only).

Every request is forwarded to the real server and its reply returned unchanged, except
``GET /version`` and ``GET /lmc_version``, which answer ``version``: a real server posing as
a newer release, to test what connect() does with a server it does not know.
"""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class VersionProxy:
    """Serve ``http://127.0.0.1:<port>`` in front of ``target_http_url``, claiming ``version``."""

    def __init__(self, target_http_url: str, version: str) -> None:
        host, port = target_http_url.removeprefix("http://").rsplit(":", 1)
        target = (host, int(port))
        claimed = json.dumps(version).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _forward(self) -> None:
                if self.path in ("/version", "/lmc_version"):
                    self._reply(200, {"Content-Type": "application/json"}, claimed)
                    return
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                conn = http.client.HTTPConnection(*target, timeout=10)
                try:
                    hdrs = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    conn.request(self.command, self.path, body=body, headers=hdrs)
                    resp = conn.getresponse()
                    self._reply(resp.status, dict(resp.getheaders()), resp.read())
                finally:
                    conn.close()

            def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="version-proxy")
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> VersionProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
