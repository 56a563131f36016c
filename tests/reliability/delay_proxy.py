"""A ZMQ proxy in front of a real LMCache server that holds chosen requests (tests only).

The client connects to :attr:`DelayProxy.url` (and to the real server's HTTP URL); every
client socket gets its own DEALER towards the server, so the server still sees one
identity per client socket (its affinity pool depends on it). Requests whose operation
is in :meth:`hold` are kept until :meth:`release`: the server then runs them *after* the
client gave up on them -- exactly what a frozen server does, for one operation only.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq

from lmcache_kv_fast.protocol.ops import GEN_056

_ID_TO_NAME = {v: k.value for k, v in GEN_056.op_ids.items()}


class DelayProxy:
    """Forward ``[uid, op, payload...]`` requests to ``server_url``; hold some of them.

    Args:
        server_url: ZMQ URL of the real server.
    """

    def __init__(self, server_url: str) -> None:
        self._zctx = zmq.Context()
        self._front = self._zctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self._server_url = server_url
        self._backs: dict[bytes, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._hold: set[str] = set()
        self._held: list[tuple[bytes, list[bytes]]] = []
        self._release = False
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self._thread.start()

    def hold(self, *ops: str) -> None:
        """Hold requests of these operations (names) from now on."""
        with self._lock:
            self._hold = set(ops)

    def held(self) -> list[str]:
        """Operations of the requests held now."""
        with self._lock:
            return [_op_name(f[1]) for _, f in self._held]

    def release(self) -> None:
        """Stop holding; forward the held requests (in order)."""
        with self._lock:
            self._hold = set()
            self._release = True

    def close(self) -> None:
        """Stop the proxy thread and close its sockets."""
        self._stop.set()
        self._thread.join(5)
        for s in self._backs.values():
            s.close(0)
        self._front.close(0)
        self._zctx.term()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _back(self, ident: bytes, poller: zmq.Poller) -> zmq.Socket:
        s = self._backs.get(ident)
        if s is None:
            s = self._zctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self._server_url)
            self._backs[ident] = s
            poller.register(s, zmq.POLLIN)
        return s

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        while not self._stop.is_set():
            with self._lock:
                out = self._held if self._release else []
                if self._release:
                    self._held, self._release = [], False
            for ident, frames in out:
                self._back(ident, poller).send_multipart(frames)
            for sock, _ in poller.poll(10):
                if sock is self._front:
                    ident, *frames = self._front.recv_multipart()
                    name = _op_name(frames[1]) if len(frames) > 1 else "?"
                    with self._lock:
                        self.seen.append(name)
                        if name in self._hold:
                            self._held.append((ident, frames))
                            continue
                    self._back(ident, poller).send_multipart(frames)
                else:
                    frames = sock.recv_multipart()
                    ident = next(i for i, s in self._backs.items() if s is sock)
                    self._front.send_multipart([ident, *frames])


def _op_name(frame: bytes) -> str:
    try:
        v: Any = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return "?"
    return _ID_TO_NAME.get(v, str(v)) if isinstance(v, int) else str(v)
