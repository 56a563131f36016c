"""KV events against a real LMCache 0.5.6 server: subscription, SDK announcements, vLLM publisher.

The lmcache-driven store path (the one that makes the server record ``stored`` events) is
driven with lmcache itself as a test dependency (docs/protocol.md §10.3). The subscriber of the vLLM
wire format decodes with its own msgspec schema, written here from vLLM's field list.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq
from conftest import make_model, rand_tokens, start_server, unique_model_name
from lmc_writer import LmcDrivenWriter

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import events
from lmcache_kv_fast.hashing import chunk_hashes
from lmcache_kv_fast.testing import LMCacheServer, free_port

pytest.importorskip("blake3")

_OUR_THREADS = ("lmcache-kv-fast-events-", "lmcache-kv-fast-publisher-")


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every subscription / publisher thread of a test is gone after it."""
    yield
    deadline = time.monotonic() + 3
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(_OUR_THREADS)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"leaked threads: {left}"


# ------------------------------------------------------------------ vLLM schema (own copy)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """A vLLM-style SUB client that decodes every frame it gets."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.topic = topic.encode()
        self.frames: list[tuple[int, KVEventBatch]] = []
        time.sleep(0.5)  # PUB/SUB slow joiner: let the subscription reach the publisher

    def events_until(self, pred: Callable[[list[Any]], bool], timeout: float = 15.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while not pred(self.events()):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {self.events()}"
            if self.sock.poll(int(min(left, 0.2) * 1000)):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == self.topic
                assert len(seq) == 8
                self.frames.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return self.events()

    def events(self) -> list[Any]:
        return [e for _, b in self.frames for e in b.events]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def lmc(server_shm: LMCacheServer) -> Iterator[LmcDrivenWriter]:
    pytest.importorskip("lmcache.v1.multiprocess.transfer_context.worker_transfer")
    w = LmcDrivenWriter(server_shm, unique_model_name("ev"))
    yield w
    w.close()


def endpoint(server: LMCacheServer, model: str) -> events.EventsEndpoint:
    return events.EventsEndpoint.probe(server.url, server.http_url, model, timeout=10.0)


def next_with_events(sub: events.KVEventSubscription, timeout: float = 10.0
                     ) -> events.KVEventBatch:
    deadline = time.monotonic() + timeout
    while True:
        b = sub.poll(max(0.0, deadline - time.monotonic()))
        assert b is not None, "no batch with events in time"
        if b.events:
            return b


def subscribers(server: LMCacheServer) -> int:
    return int(server.status()["kv_events"]["subscribers"])


def sdk_store(ctx: Any, kv: torch.Tensor, tokens: list[int]) -> None:
    """Store through the SDK; announce by hand if the context does not announce itself."""
    seen: list[Any] = []
    remove = events.add_listener(ctx.model_name, seen.append)
    try:
        assert ctx.store(kv, tokens)
    finally:
        remove()
    if not seen:  # the context's announce hook is not wired (yet)
        n = len(tokens) // ctx.chunk_size
        events.announce_store(ctx, tokens[: n * ctx.chunk_size], "", n)


# ------------------------------------------------------------------ subscription
def test_lmcache_driven_store_and_clear_stream(server_shm, lmc):
    c = server_shm.chunk_size
    tokens = rand_tokens(2 * c, seed=11)
    hashes = chunk_hashes(tokens, c)
    before = subscribers(server_shm)
    sub = events.subscribe(endpoint(server_shm, lmc.model), max_events=1, timeout=10.0)
    first = next(sub)
    assert first.enabled and not first.lost and first.events == []
    assert subscribers(server_shm) == before + 1

    lmc.store(tokens)
    b1 = next_with_events(sub)
    b2 = next_with_events(sub)  # max_events=1: one record per batch, acked in between
    recs = b1.events + b2.events
    assert [r.kind for r in recs] == ["stored", "stored"]
    assert [r.block_hashes for r in recs] == [[hashes[0]], [hashes[1]]]
    assert recs[0].parent_block_hash is None and recs[1].parent_block_hash == hashes[0]
    assert recs[0].token_ids == tokens[:c] and recs[1].token_ids == tokens[c:]
    assert all(r.medium == "CPU" and r.model_name == lmc.model for r in recs)
    assert b2.next_cursor == recs[1].seq == recs[0].seq + 1 == b1.next_cursor + 1

    server_shm.clear()
    rm = next_with_events(sub)
    assert [r.kind for r in rm.events] == ["removed"]
    assert set(rm.events[0].block_hashes) == set(hashes)
    assert rm.events[0].parent_block_hash is None and rm.events[0].token_ids == []
    cursor = sub.cursor
    assert cursor == rm.next_cursor
    sub.close()
    assert sub.closed and subscribers(server_shm) == before
    with pytest.raises(StopIteration):
        next(sub)

    # resume at the cursor: nothing is replayed
    with events.subscribe(endpoint(server_shm, lmc.model), cursor=cursor, timeout=0.3) as again:
        b = next(again)
        assert b.events == [] and not b.lost and b.incarnation == rm.incarnation
        with pytest.raises(events.KVEventTimeout):
            next(again)
        assert again.active
    assert subscribers(server_shm) == before


def test_sdk_store_hashes_equal_server_removed_hashes(server_shm):
    model = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=32)
    c = server_shm.chunk_size
    tokens = rand_tokens(2 * c + 17)  # fresh: no token binding on the server
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, model.name, timeout=20) as ctx, \
            events.subscribe(ctx, timeout=10.0) as sub:
        next(sub)
        assert ctx.store(model.kv(len(tokens)), tokens)
        # the server records no `stored` event for SDK (engine-driven) stores (docs/protocol.md §11 #21)
        assert sub.poll(0.5) is None
        server_shm.clear()
        rm = next_with_events(sub)
    assert [r.kind for r in rm.events] == ["removed"]
    assert set(rm.events[0].block_hashes) == set(chunk_hashes(tokens, c))
    assert len(chunk_hashes(tokens, c)) == 2


def test_future_cursor_reports_lost(server_shm):
    with events.subscribe(endpoint(server_shm, unique_model_name("lost")),
                          cursor=10**12) as sub:
        b = next(sub)
    assert b.lost and b.resync and not b.incarnation_changed
    assert b.next_cursor < 10**12


def test_same_instance_id_replaces_subscription(server_shm):
    ep = endpoint(server_shm, unique_model_name("repl"))
    before = subscribers(server_shm)
    first = events.subscribe(ep, timeout=10.0)
    next(first)
    second = events.subscribe(ep, instance_id=first.instance_id)
    try:
        with pytest.raises(StopIteration):
            next(first)
        assert "newer subscription" in (first.end_reason or "")
        assert first.closed and second.active
        assert subscribers(server_shm) == before + 1
    finally:
        second.close()
        first.close()
    assert subscribers(server_shm) == before


def test_context_close_closes_subscription(server_shm):
    model = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=32)
    before = subscribers(server_shm)
    ctx = lmc_sdk.connect(server_shm.url, server_shm.http_url, model.name, timeout=20)
    sub = events.subscribe(ctx)
    next(sub)
    assert subscribers(server_shm) == before + 1
    ctx.close()
    deadline = time.monotonic() + 5
    while not sub.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sub.closed and "context" in (sub.end_reason or "")
    assert subscribers(server_shm) == before
    with pytest.raises(StopIteration):
        next(sub)


def test_blocked_iteration_wakes_on_close_from_another_thread(server_shm):
    sub = events.subscribe(endpoint(server_shm, unique_model_name("wake")))
    next(sub)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(list(sub)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    sub.close()
    t.join(5)
    assert not t.is_alive() and out == [[]]
    assert time.monotonic() - t0 < 2


# ------------------------------------------------------------------ vLLM publisher
def test_publisher_vllm_wire_sequence(server_shm, lmc):
    c = server_shm.chunk_size
    a, b = rand_tokens(2 * c, seed=21), rand_tokens(2 * c, seed=22)
    ha, hb = chunk_hashes(a, c), chunk_hashes(b, c)
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    printed: list[tuple[int, Any]] = []
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, lmc.model, timeout=20) as ctx:
        kv_b = torch.randn(ctx.kv_shape(len(b)), dtype=torch.float32).to(ctx.dtype)
        with events.KVEventPublisher(ctx, publish=pub_ep, replay=replay_ep, topic="kv-events",
                                     on_publish=lambda s, bt: printed.append((s, bt))) as pub:
            sub = Subscriber(pub_ep, "kv-events")
            try:
                lmc.store(a)  # server `stored` records
                sub.events_until(lambda ev: len(ev) >= 2)
                sdk_store(ctx, kv_b, b)  # this SDK's announcement
                events.announce_store(ctx, a, "", 2)  # already announced: nothing new
                sub.events_until(lambda ev: len(ev) >= 4)
                server_shm.clear()
                got = sub.events_until(
                    lambda ev: {h for e in ev if isinstance(e, BlockRemoved)
                                for h in e.block_hashes} >= {*ha, *hb})
                n_removed = len(got) - 4
                # Storing `a` again through the SDK: the server now also records `stored`
                # (it still has the token binding from the lmcache-driven store) and the
                # SDK announces it: published once.
                kv_a = torch.randn(ctx.kv_shape(len(a)), dtype=torch.float32).to(ctx.dtype)
                sdk_store(ctx, kv_a, a)
                sub.events_until(lambda ev: len(ev) >= 4 + n_removed + 2)
                time.sleep(0.5)
                got = sub.events()
                seqs = [s for s, _ in sub.frames]
                batches = [bt for _, bt in sub.frames]
            finally:
                sub.close()
            replay = fetch_replay(replay_ep, 0)
            assert pub.mapper.announced == set(ha)

    assert got[:4] == [
        BlockStored([ha[0]], None, a[:c], c, None, "CPU", None),
        BlockStored([ha[1]], ha[0], a[c:], c, None, "CPU", None),
        BlockStored([hb[0]], None, b[:c], c, None, "CPU", None),
        BlockStored([hb[1]], hb[0], b[c:], c, None, "CPU", None),
    ]
    removed = got[4:4 + n_removed]
    assert removed and all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted({*ha, *hb})
    assert got[4 + n_removed:] == got[:2]  # re-announced exactly once
    assert seqs == list(range(len(seqs)))
    assert all(bt.data_parallel_rank == 0 and bt.ts > 1e9 for bt in batches)
    assert [s for s, _ in printed] == seqs
    # the replay socket returns every batch, byte for byte as published, then the end marker
    assert [s for s, _ in replay] == seqs
    assert [DECODER.decode(p) for _, p in replay] == batches


def fetch_replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay ROUTER for every batch from ``start``.

    A DEALER with an empty delimiter frame: a REQ socket (as in vLLM's example subscriber)
    only ever receives the first reply message of a request.
    """
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    out: list[tuple[int, bytes]] = []
    try:
        req.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert req.poll(5000), "replay timed out"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if not payload:
                assert seq == (-1).to_bytes(8, "big", signed=True)
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        req.close(0)
        ctx.term()


@pytest.fixture
def own_server() -> Iterator[LMCacheServer]:
    yield from start_server(False, l1_size_gb=0.25, chunk_size=32)


def test_publisher_withdraws_everything_on_server_restart(own_server):
    pytest.importorskip("lmcache.v1.multiprocess.transfer_context.worker_transfer")
    model = unique_model_name("restart")
    c = own_server.chunk_size
    tokens = rand_tokens(2 * c, seed=31)
    h = chunk_hashes(tokens, c)
    pub_ep = f"tcp://127.0.0.1:{free_port()}"
    w = LmcDrivenWriter(own_server, model, max_tokens=2 * c)
    with events.KVEventPublisher(own_server.url, http_url=own_server.http_url,
                                 model_name=model, publish=pub_ep) as pub:
        sub = Subscriber(pub_ep, events.DEFAULT_TOPIC)
        try:
            w.store(tokens)
            sub.events_until(lambda ev: len(ev) == 2)
            w.close(unregister=False)
            own_server.restart()
            got = sub.events_until(lambda ev: len(ev) == 3, timeout=20)
            assert got[2] == BlockRemoved(sorted(h), "CPU")
            assert pub.mapper.announced == set()
            # ... and then it goes on with the new server
            w = LmcDrivenWriter(own_server, model, max_tokens=2 * c)
            w.store(tokens)
            got = sub.events_until(lambda ev: len(ev) == 5, timeout=20)
            assert got[3:] == [BlockStored([h[0]], None, tokens[:c], c, None, "CPU", None),
                               BlockStored([h[1]], h[0], tokens[c:], c, None, "CPU", None)]
        finally:
            sub.close()
            w.close()


# ------------------------------------------------------------------ CLI
def test_events_cli_publishes_prints_and_stops_on_sigterm(server_shm, lmc):
    c = server_shm.chunk_size
    tokens = rand_tokens(2 * c, seed=41)
    pub_ep = f"tcp://127.0.0.1:{free_port()}"
    code = "import sys; from lmcache_kv_fast.events import events_main; " \
           "sys.exit(events_main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--url", server_shm.url, "--http-url",
         server_shm.http_url, "--model", lmc.model, "--publish", pub_ep, "--print"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        sub = Subscriber(pub_ep, "kv-events")
        try:
            deadline = time.monotonic() + 30
            while b"publishing KV events" not in _peek(proc) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.3)
            lmc.store(tokens)
            got = sub.events_until(lambda ev: len(ev) >= 2, timeout=20)
        finally:
            sub.close()
        assert [e.block_hashes for e in got] == [[h] for h in chunk_hashes(tokens, c)]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = _OUT.get(proc.pid, b"") + out
    assert proc.returncode == 0, text.decode(errors="replace")
    assert b"Received event batch at" in text and b"BlockStored(block_hashes=" in text


_OUT: dict[int, bytes] = {}


def _peek(proc: subprocess.Popen[bytes]) -> bytes:
    """Read what the child printed so far without blocking."""
    import fcntl

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
    try:
        chunk = proc.stdout.read() or b""
    except BlockingIOError:
        chunk = b""
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, fl)
    _OUT[proc.pid] = _OUT.get(proc.pid, b"") + chunk
    return _OUT[proc.pid]
