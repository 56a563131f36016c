"""Minimal LMCache 0.5.6 MP client for the reproduction scripts (pyzmq + msgspec only).

Operations are sent by name (0.5.6 accepts a string operation frame); every request is
``[uid, op, payload...]`` on a DEALER socket and every reply ``[uid, op(, value)]``.
The server never sends an error reply: a request it rejects just gets no answer.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import random
import time
import urllib.request
from typing import Any

import msgspec
import zmq

_ENC = msgspec.msgpack.Encoder()
_UIDS = itertools.count(1)


class Server:
    """One LMCache MP server: its ZMQ URL and its HTTP info plane."""

    def __init__(self, url: str, http_url: str, timeout: float = 10.0) -> None:
        self.url = url
        self.http_url = http_url.rstrip("/")
        self.timeout = timeout
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)
        cfg = self.get("/config")
        self.chunk_size: int = cfg["mp"]["chunk_size"]
        self.config = cfg

    def get(self, path: str) -> Any:
        """GET a JSON document of the HTTP info plane."""
        with urllib.request.urlopen(self.http_url + path, timeout=self.timeout) as r:
            return json.loads(r.read())

    def call(self, op: str, *payloads: Any, timeout: float | None = None) -> Any:
        """Send one request and return its decoded reply (None for a 2-frame reply)."""
        uid = next(_UIDS)
        self._sock.send_multipart([_ENC.encode(uid), _ENC.encode(op),
                                   *(_ENC.encode(p) for p in payloads)])
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"{op}: no reply (the server sends no error replies: "
                                   "see its log)")
            frames = self._sock.recv_multipart()
            if msgspec.msgpack.decode(frames[0]) == uid:
                return msgspec.msgpack.decode(frames[2]) if len(frames) > 2 else None

    def l1(self) -> dict[str, Any]:
        """The L1 counters of ``/status``."""
        return self.get("/status")["storage_manager"]["l1_manager"]

    def registered(self, iid: int) -> bool:
        """Whether ``iid`` has an engine-driven registration."""
        return str(iid) in (self.get("/status").get("non_cuda_context_meta") or {})

    def close(self) -> None:
        self._sock.close(0)
        self._zctx.term()


class Model:
    """A tiny model registered through engine-driven registrations only."""

    LAYERS, HIDDEN = 2, 256  # bfloat16: one chunk object = 2*2*chunk*256*2 bytes

    def __init__(self, srv: Server, name: str | None = None) -> None:
        self.srv = srv
        self.name = name or f"repro-{os.getpid()}-{random.randrange(1 << 30)}"

    def register(self) -> tuple[int, str]:
        """Register a fresh instance; return its id and the SHM pool name."""
        iid = random.randrange(1, 1 << 63)
        resp = self.srv.call("register_kv_cache_engine_driven_context", {
            "instance_id": iid, "model_name": self.name, "world_size": 1, "block_size": 16,
            "num_layers": self.LAYERS, "hidden_dim_size": self.HIDDEN, "dtype_str": "bfloat16",
            "use_mla": False, "num_physical_slots": self.srv.chunk_size})
        if not resp["shm_name"]:
            raise SystemExit("this reproduction needs an SHM server (--shm-name ... "
                             "--no-l1-use-lazy)")
        return iid, resp["shm_name"]

    def key(self, tokens: list[int], rid: str, worker_id: int | None) -> dict[str, Any]:
        """An IPCCacheServerKey map (all ten fields, in declaration order)."""
        return {"model_name": self.name, "world_size": 1, "worker_id": worker_id,
                "token_ids": tokens, "start": 0, "end": len(tokens), "request_id": rid,
                "cache_salt": "", "request_configs": None, "num_kv_readers": 1}

    def prepare_store(self, iid: int, tokens: list[int], rid: str) -> list[dict[str, Any]]:
        """Reserve slots for ``tokens`` (whole chunks) as ``iid``; return the slots."""
        resp = self.srv.call("prepare_store", self.key(tokens, rid, 0), iid)
        return resp["context"]["slots"]

    def lookup(self, tokens: list[int], rid: str) -> int:
        """Leading hit chunks of ``tokens`` (read-locked until released)."""
        self.srv.call("lookup", self.key(tokens, rid, None), 1)
        while True:
            n = self.srv.call("wait_prefetch_status", rid, 0.5)
            if n is not None:
                return int(n)

    def read_hit(self, iid: int, tokens: list[int], rid: str, shm_name: str) -> bytes | None:
        """After a hit lookup: read the first chunk's bytes, release the lock, end."""
        resp = self.srv.call("prepare_retrieve", self.key(tokens, rid, 0), iid)
        data = None
        if resp["success"]:
            slot = resp["context"]["slots"][0]
            data = read_slot(shm_name, slot)
            self.srv.call("commit_retrieve", self.key(tokens, rid, 0), iid)
        else:
            self.srv.call("free_lookup_locks", self.key(tokens, rid, None), 1)
        self.srv.call("end_session", rid)
        return data


def read_slot(shm_name: str, slot: dict[str, Any]) -> bytes:
    """The bytes of one slot of the SHM pool."""
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            return bytes(m[slot["offset"]:slot["offset"] + slot["length"]])
    finally:
        os.close(fd)


def write_slot(shm_name: str, slot: dict[str, Any], data: bytes) -> None:
    """Write ``data`` at the start of one slot of the SHM pool."""
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size) as m:
            m[slot["offset"]:slot["offset"] + len(data)] = data
    finally:
        os.close(fd)


def describe(data: bytes) -> str:
    """Short description of a chunk's bytes."""
    if not data:
        return "no bytes"
    distinct = sorted(set(data[:65536]))
    if len(distinct) == 1:
        return f"{len(data)} bytes, all 0x{distinct[0]:02x}"
    return f"{len(data)} bytes, first {data[:8].hex()}"


def tokens(n: int, seed: int) -> list[int]:
    """``n`` pseudo-random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(1 << 31) for _ in range(n)]
