"""A ZMQ forwarder from an ``ipc://`` endpoint to a real server's ``tcp://`` endpoint.

The 0.5.6 server binds TCP only; an ``ipc://`` URL (which upstream's request client
accepts) reaches it through a forwarder like this one. Each client connection (ROUTER
identity) gets its own DEALER to the server, so the server sees ordinary DEALER frames.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid

import zmq


class IpcForwarder:
    """Forward ``ipc://<tmp>/lmckvf-<id>.sock`` to ``target`` on a background thread."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.path = os.path.join(tempfile.gettempdir(), f"lmckvf-{uuid.uuid4().hex[:10]}.sock")
        self.url = f"ipc://{self.path}"
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread: threading.Thread | None = None
        self.forwarded = 0

    def __enter__(self) -> IpcForwarder:
        front = self._ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.bind(self.url)
        self._thread = threading.Thread(target=self._run, args=(front,), daemon=True)
        self._thread.start()
        return self

    def _run(self, front: zmq.Socket) -> None:
        backs: dict[bytes, zmq.Socket] = {}
        owner: dict[zmq.Socket, bytes] = {}
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    if sock is front:
                        ident, *frames = front.recv_multipart()
                        back = backs.get(ident)
                        if back is None:
                            back = self._ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(self.target)
                            backs[ident], owner[back] = back, ident
                            poller.register(back, zmq.POLLIN)
                        back.send_multipart(frames)
                        self.forwarded += 1
                    else:
                        front.send_multipart([owner[sock], *sock.recv_multipart()])
        finally:
            for back in backs.values():
                back.close(0)
            front.close(0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._ctx.term()
        if os.path.exists(self.path):
            os.unlink(self.path)
