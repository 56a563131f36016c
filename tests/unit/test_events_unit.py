"""KV events without a real server: hashing, stream protocol (scripted ROUTER), mapping, wire."""

from __future__ import annotations

import gc
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from lmcache_kv_fast import errors, events, hashing
from lmcache_kv_fast.protocol.ops import GEN_055, GEN_056
from lmcache_kv_fast.protocol.types import KVEventRecord
from lmcache_kv_fast.testing import free_port

blake3 = pytest.importorskip("blake3")

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode

NONE_HASH_HEX = "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"  # docs/protocol.md §8.1
# What a live 0.5.6 server reported (stored event) for tokens 100..131 at chunk size 32.
LIVE_H0_HEX = "488fbf3a7810035a4026dc403e71f90cb706ea6e9a4bf0fd9b8d9a4d42e34966"


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 3
    prefixes = ("lmcache-kv-fast-events-", "lmcache-kv-fast-publisher-")
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"leaked threads: {left}"


# ------------------------------------------------------------------ hashing
def test_none_hash_and_live_vector():
    assert hashing.none_hash().hex() == NONE_HASH_HEX
    hs = hashing.chunk_hashes(list(range(100, 164)), 32)
    assert len(hs) == 2 and hs[0].hex() == LIVE_H0_HEX
    assert all(len(h) == 32 for h in hs)


def test_chain_matches_formula_and_drops_partial_chunk():
    toks = [*range(10), 2**32 - 1, 0]
    hs = hashing.chunk_hashes(toks, 4)
    assert len(hs) == 3
    prev = bytes.fromhex(NONE_HASH_HEX)
    for i, h in enumerate(hs):
        want = blake3.blake3(prev + b"".join(t.to_bytes(4, "big")
                                             for t in toks[4 * i:4 * i + 4])).digest()
        assert h == want
        prev = h
    assert hashing.chunk_hashes([*toks, 5, 6], 4) == hs
    assert hashing.chunk_hashes(toks, 4, max_chunks=1) == hs[:1]
    assert hashing.chunk_hashes(toks[:3], 4) == []


@pytest.mark.parametrize("toks, c", [([1, 2], 0), ([1, 2], True), ([1, -1], 2),
                                     ([2**32, 1], 2), ([1.5, 2], 2)])
def test_chunk_hashes_rejects_bad_input(toks, c):
    with pytest.raises(errors.InvalidArgumentError):
        hashing.chunk_hashes(toks, c)


def test_missing_blake3_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(hashing, "_blake3_module", None)
    monkeypatch.setattr(hashing, "_none_hash", None)
    monkeypatch.setitem(sys.modules, "blake3", None)
    with pytest.raises(errors.KVCacheSDKError, match="pip install blake3"):
        hashing.chunk_hashes([1, 2, 3, 4], 2)
    assert not hashing.blake3_available()
    # announcing without listeners never needs it, and never raises
    ctx = Target("m-noblake", chunk_size=2)
    assert events.announce_store(ctx, [1, 2, 3, 4]) == []
    with pytest.raises(errors.KVCacheSDKError, match="blake3"):
        events.add_listener("m-noblake", lambda a: None)


# ------------------------------------------------------------------ fake server
class FakeServer:
    """A scripted ROUTER that speaks just enough of the MP protocol (docs/protocol.md §2.6)."""

    def __init__(self, experimental: list[str] | None = None, answer: bool = True,
                 incarnation: int = 111, port: int | None = None) -> None:
        self.experimental = ["kv_event_stream"] if experimental is None else experimental
        self.answer = answer
        self.answer_pings = True
        self.incarnation = incarnation
        self.received: queue.Queue[list[bytes]] = queue.Queue()
        self.subscribes: list[tuple[int, str, int, int]] = []
        self.stream: tuple[bytes, bytes, bytes] | None = None
        self.next_cursor = 0
        self._out: queue.Queue[list[bytes]] = queue.Queue()
        self._stop = threading.Event()
        self.port = port or free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        assert self._ready.wait(5)

    def batch(self, records: list[dict[str, Any]] | None = None, **kw: Any) -> dict[str, Any]:
        records = records or []
        if records:
            self.next_cursor = records[-1]["seq"]
        return {"enabled": True, "incarnation": self.incarnation,
                "next_cursor": self.next_cursor, "lost": False, "events": records, **kw}

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.url)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(20):
                    frames = sock.recv_multipart()
                    for reply in self._handle(frames):
                        sock.send_multipart(reply)
                while True:
                    try:
                        sock.send_multipart(self._out.get_nowait())
                    except queue.Empty:
                        break
        finally:
            sock.close(0)

    def _handle(self, frames: list[bytes]) -> list[list[bytes]]:
        ident, uid, op, *payload = frames
        self.received.put([uid, op, *payload])
        if op == b"":
            if payload == [b"cancel"] and self.stream and self.stream[1] == uid:
                stream_op = self.stream[2]
                self.stream = None
                return [[ident, uid, stream_op]]  # end marker echoes the subscribe op
            return []
        name = dec(op)
        if name == "get_experimental":
            return [[ident, uid, op, enc(self.experimental)]] if self.answer else []
        if name == "subscribe_kv_events":
            iid, model, cursor, max_events = (dec(p) for p in payload)
            self.subscribes.append((iid, model, cursor, max_events))
            self.stream = (ident, uid, op)
            return [[ident, uid, op, enc(self.batch())]]
        if name == 22:  # ping
            return [[ident, uid, op, enc(True)]] if self.answer_pings else []
        return []

    def push(self, payload: Any) -> None:
        assert self.stream is not None
        ident, uid, op = self.stream
        self._out.put([ident, uid, op, payload if isinstance(payload, bytes) else enc(payload)])

    def end_stream(self) -> None:
        assert self.stream is not None
        ident, uid, op = self.stream
        self._out.put([ident, uid, op])

    def controls(self) -> list[list[bytes]]:
        out = []
        for frames in self.drain():
            if frames[1] == b"":
                out.append(frames)
        return out

    def drain(self) -> list[list[bytes]]:
        out = []
        while True:
            try:
                out.append(self.received.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.term()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.close()


def endpoint(url: str, *, gen=GEN_056, timeout: float = 1.0, reap: float = 4.0,
             model: str = "m") -> events.EventsEndpoint:
    return events.EventsEndpoint(url=url, http_url="http://127.0.0.1:1", model_name=model,
                                 generation=gen, chunk_size=4, timeout=timeout,
                                 reap_timeout_s=reap)


def rec(seq: int, kind: str = "stored", hashes: list[bytes] | None = None,
        parent: bytes | None = None, tokens: list[int] | None = None) -> dict[str, Any]:
    return {"seq": seq, "kind": kind, "medium": "CPU", "model_name": "m",
            "block_hashes": hashes or [bytes([seq]) * 32], "parent_block_hash": parent,
            "token_ids": [1, 2, 3, 4] if tokens is None and kind == "stored" else tokens or []}


def wait_for(pred, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# ------------------------------------------------------------------ stream protocol
def test_subscribe_request_credit_ack_and_cancel(fake):
    sub = events.subscribe(endpoint(fake.url), cursor=7, max_events=3, timeout=1.0)
    first = fake.drain()
    assert [dec(f[1]) for f in first] == ["get_experimental", "subscribe_kv_events"]
    uid = first[1][0]
    assert fake.subscribes == [(sub.instance_id, "m", 7, 3)]
    assert 0 < sub.instance_id < 2**63

    b0 = next(sub)
    assert isinstance(b0, events.KVEventBatch) and b0.events == [] and b0.incarnation == 111
    time.sleep(0.2)
    assert fake.controls() == []  # not acked until the next batch is asked for

    assert sub.poll(0.2) is None  # asking sends the ack
    assert fake.controls() == [[uid, b"", b"ack"]]
    fake.push(fake.batch([rec(8), rec(9, parent=bytes([8]) * 32)]))
    b1 = sub.poll(2.0)
    assert b1 is not None and [r.seq for r in b1.events] == [8, 9]
    assert isinstance(b1.events[0], KVEventRecord)
    assert b1.events[1].parent_block_hash == bytes([8]) * 32
    assert sub.cursor == 9 and sub.incarnation == 111

    t0 = time.monotonic()
    sub.close()
    assert time.monotonic() - t0 < 0.5  # the end marker came back
    assert fake.controls() == [[uid, b"", b"cancel"]]  # no ack for a batch we stop after
    assert sub.closed and not sub.active
    with pytest.raises(StopIteration):
        next(sub)
    sub.close()  # idempotent


def test_timeout_semantics(fake):
    with events.subscribe(endpoint(fake.url), timeout=0.3) as sub:
        next(sub)
        t0 = time.monotonic()
        with pytest.raises(events.KVEventTimeout) as ei:
            next(sub)
        assert 0.25 < time.monotonic() - t0 < 1.0
        assert isinstance(ei.value, errors.ServerTimeoutError)
        assert sub.active  # still usable
        fake.push(fake.batch([rec(1)]))
        assert next(sub).events[0].seq == 1


def test_server_end_marker_stops_iteration(fake):
    sub = events.subscribe(endpoint(fake.url))
    assert list(_take(sub, 1))
    fake.end_stream()
    assert list(sub) == []
    assert "ended the stream" in (sub.end_reason or "") and sub.closed
    assert [f for f in fake.controls() if f[2] == b"cancel"] == []


def _take(sub: events.KVEventSubscription, n: int) -> Iterator[events.KVEventBatch]:
    for _ in range(n):
        yield next(sub)


def test_malformed_batch_is_a_protocol_error(fake):
    sub = events.subscribe(endpoint(fake.url), timeout=2.0)
    next(sub)
    sub.poll(0.1)  # ack
    fake.push(enc({"enabled": "yes"}))
    with pytest.raises(errors.ProtocolError):
        next(sub)
    assert sub.closed


def test_batch_flags_lost_and_incarnation(fake):
    with events.subscribe(endpoint(fake.url), timeout=2.0) as sub:
        assert not next(sub).resync
        fake.push(fake.batch(lost=True))
        b = next(sub)
        assert b.lost and b.resync and not b.incarnation_changed
        fake.incarnation = 222
        fake.push(fake.batch())
        b = next(sub)
        assert b.incarnation_changed and b.resync and sub.incarnation == 222


def test_ping_thread_pings_the_subscription_id(fake):
    with events.subscribe(endpoint(fake.url, reap=4.0)) as sub:  # ping every 1 s
        seen: list[list[bytes]] = []
        wait_for(lambda: any(dec(f[1]) == 22 for f in seen.extend(fake.drain()) or seen),
                 timeout=3)
        ping = next(f for f in seen if dec(f[1]) == 22)
        assert dec(ping[2]) == sub.instance_id


def test_unanswered_pings_warn_once_per_silence(fake, caplog):
    fake.answer_pings = False
    with caplog.at_level("DEBUG", logger="lmcache_kv_fast.transport.heartbeat"), \
            events.subscribe(endpoint(fake.url, reap=4.0)):  # ping every 1 s
        wait_for(lambda: sum("got no reply" in r.message for r in caplog.records) >= 2,
                 timeout=5)
        fake.answer_pings = True
        time.sleep(2.3)  # two more pings: the first of them is answered
    missed = [r for r in caplog.records if "got no reply" in r.message]
    assert [r.levelname for r in missed[:2]] == ["WARNING", "DEBUG"]
    assert "KV event subscription ping" in missed[0].message and fake.url in missed[0].message
    assert sum(r.levelname == "WARNING" for r in missed) == 1


def test_dropped_subscription_is_closed_by_gc(fake):
    sub = events.subscribe(endpoint(fake.url))
    next(sub)
    assert fake.stream is not None
    uid = fake.stream[1]
    fake.drain()
    del sub
    gc.collect()
    seen: list[list[bytes]] = []
    wait_for(lambda: [uid, b"", b"cancel"] in (seen.extend(fake.drain()) or seen))


def test_capability_missing_refused_before_subscribing():
    srv = FakeServer(experimental=[])
    try:
        with pytest.raises(errors.KVCacheSDKError, match="does not record KV events"):
            events.subscribe(endpoint(srv.url))
        assert srv.subscribes == []
    finally:
        srv.close()


def test_no_reply_is_a_clear_error_quickly():
    srv = FakeServer(answer=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.KVCacheSDKError, match="no reply"):
            events.subscribe(endpoint(srv.url, timeout=0.5))
        assert time.monotonic() - t0 < 2
    finally:
        srv.close()


def test_reconnect_same_server_is_invisible_and_restart_restarts_at_zero():
    port = free_port()
    srv = FakeServer(port=port, incarnation=1)
    sub = events.subscribe(endpoint(srv.url), timeout=5.0)
    try:
        next(sub)
        srv.push(srv.batch([rec(5)]))
        assert next(sub).next_cursor == 5
        # the connection drops; the same server (same incarnation) comes back
        srv.close()
        srv = FakeServer(port=port, incarnation=1)
        srv.next_cursor = 5
        assert sub.poll(1.5) is None  # the resubscription's status batch is not surfaced
        assert [s[2] for s in srv.subscribes] == [5]
        srv.push(srv.batch([rec(6)]))
        b = next(sub)
        assert [r.seq for r in b.events] == [6] and not b.incarnation_changed
        # now a restart: new incarnation, the cursor of the old log is meaningless
        srv.close()
        srv = FakeServer(port=port, incarnation=2)
        b = sub.poll(5.0)
        assert b is not None and b.incarnation_changed and b.incarnation == 2
        assert [s[2] for s in srv.subscribes] == [6, 0]
        assert len({s[0] for s in srv.subscribes}) == 1  # same instance id: replaced
    finally:
        sub.close()
        srv.close()


# ------------------------------------------------------------------ argument checks
@pytest.mark.parametrize("kw, exc", [
    (dict(cursor=-1), errors.InvalidArgumentError),
    (dict(cursor=1.0), errors.InvalidTypeError),
    (dict(cursor=True), errors.InvalidTypeError),
    (dict(max_events=0), errors.InvalidArgumentError),
    (dict(max_events=1025), errors.InvalidArgumentError),
    (dict(max_events="8"), errors.InvalidTypeError),
    (dict(timeout=0), errors.InvalidArgumentError),
    (dict(timeout=float("nan")), errors.InvalidArgumentError),
    (dict(instance_id=0), errors.InvalidArgumentError),
    (dict(instance_id=2**63), errors.InvalidArgumentError),
])
def test_bad_arguments_refused_before_sending(kw, exc):
    with pytest.raises(exc) as ei:
        events.subscribe(endpoint(f"tcp://127.0.0.1:{free_port()}"), **kw)
    assert isinstance(ei.value, errors.KVCacheSDKError)
    assert isinstance(ei.value, (ValueError, TypeError))


def test_old_generation_refused():
    with pytest.raises(errors.KVCacheSDKError, match="0.5.6"):
        events.subscribe(endpoint(f"tcp://127.0.0.1:{free_port()}", gen=GEN_055))


def test_closed_context_refused():
    class Closed:
        url, http_url, model_name, generation, closed = "tcp://127.0.0.1:1", "", "m", GEN_056, True

    with pytest.raises(errors.ContextClosedError):
        events.subscribe(Closed())


@pytest.mark.parametrize("args", [
    ("localhost:1", "http://127.0.0.1:1", "m"),
    ("tcp://127.0.0.1:1", "127.0.0.1:1", "m"),
    ("tcp://127.0.0.1:1", "http://127.0.0.1:1", ""),
    ("tcp://127.0.0.1:1", "http://127.0.0.1:1", "a@b"),
])
def test_endpoint_probe_validates(args):
    with pytest.raises(errors.InvalidArgumentError):
        events.EventsEndpoint.probe(*args)


# ------------------------------------------------------------------ announcements
class Target:
    def __init__(self, model: str, chunk_size: int = 4, url: str = "tcp://127.0.0.1:1",
                 hash_algorithm: str = "blake3") -> None:
        self.model_name, self.chunk_size, self.url = model, chunk_size, url
        self.hash_algorithm = hash_algorithm


def test_announce_store_records_and_listeners():
    ctx = Target("m-ann")
    got: list[events.StoreAnnouncement] = []
    assert not events.has_listeners("m-ann")
    assert events.announce_store(ctx, list(range(10))) == []  # nobody listens
    remove = events.add_listener(ctx, got.append)
    broken = events.add_listener("m-ann", lambda a: 1 / 0)  # logged, never raised
    try:
        assert events.has_listeners("m-ann")
        toks = list(range(10))
        recs = events.announce_store(ctx, toks, "salt", 2)
        h = hashing.chunk_hashes(toks, 4)
        assert [r.block_hashes for r in recs] == [[h[0]], [h[1]]]
        assert [r.parent_block_hash for r in recs] == [None, h[0]]
        assert [r.token_ids for r in recs] == [toks[:4], toks[4:8]]
        assert all(r.seq == events.LOCAL_SEQ and r.kind == "stored" and r.medium == "CPU"
                   and r.model_name == "m-ann" for r in recs)
        assert len(got) == 1 and got[0].cache_salt == "salt" and got[0].chunk_size == 4
        assert list(got[0].records) == recs and got[0].url == ctx.url
        assert len(events.announce_store(ctx, toks)) == 2  # None = all whole chunks
        assert events.announce_store(ctx, toks, "", 0) == []
    finally:
        remove()
        broken()
    assert not events.has_listeners("m-ann")
    assert not events.remove_listener("m-ann", got.append)


def test_add_listener_checks():
    with pytest.raises(errors.InvalidTypeError):
        events.add_listener("m", 42)  # type: ignore[arg-type]
    with pytest.raises(errors.KVCacheSDKError, match="sha256_cbor"):
        events.add_listener(Target("m-sha", hash_algorithm="sha256_cbor"), lambda a: None)
    assert not events.has_listeners("m-sha")


# ------------------------------------------------------------------ mapping
H = [bytes([i]) * 32 for i in range(6)]


def srec(seq: int, h: bytes, parent: bytes | None = None, tokens=(1, 2, 3, 4)) -> KVEventRecord:
    return KVEventRecord(seq=seq, kind="stored", model_name="m", block_hashes=[h],
                         parent_block_hash=parent, token_ids=list(tokens))


def rrec(seq: int, *hs: bytes) -> KVEventRecord:
    return KVEventRecord(seq=seq, kind="removed", model_name="m", block_hashes=list(hs))


def batch(inc: int = 1, lost: bool = False, *recs: KVEventRecord, changed: bool = False
          ) -> events.KVEventBatch:
    return events.KVEventBatch(enabled=True, incarnation=inc, next_cursor=0, lost=lost,
                               events=list(recs), incarnation_changed=changed)


def test_mapper_like_the_vllm_adapter():
    m = events.VllmEventMapper(4)
    out = m.on_batch(batch(1, False, srec(1, H[0]), srec(2, H[1], H[0]), srec(3, H[0])))
    assert out == [
        events.BlockStored([H[0]], None, [1, 2, 3, 4], 4, None, "CPU", None),
        events.BlockStored([H[1]], H[0], [1, 2, 3, 4], 4, None, "CPU", None),
    ]  # H[0] again: already announced
    assert m.on_records([srec(0, H[2], tokens=())]) == []  # no tokens: skipped
    other = KVEventRecord(seq=4, kind="stored", medium="GPU", block_hashes=[H[3]],
                          token_ids=[1])
    assert m.on_records([other, KVEventRecord(seq=5, kind="weird")]) == []
    assert m.on_records([rrec(6, H[1], H[4])]) == [events.BlockRemoved([H[1]], "CPU")]
    assert m.on_records([rrec(7, H[4])]) == []
    assert m.announced == {H[0]}


@pytest.mark.parametrize("how", ["lost", "flag", "incarnation"])
def test_mapper_withdraws_then_continues(how):
    m = events.VllmEventMapper(4)
    m.on_batch(batch(1, False, srec(1, H[3]), srec(2, H[1])))
    b = {"lost": batch(1, True, srec(9, H[2])),
         "flag": batch(1, False, srec(9, H[2]), changed=True),
         "incarnation": batch(2, False, srec(9, H[2]))}[how]
    out = m.on_batch(b)
    assert out == [events.BlockRemoved(sorted([H[1], H[3]]), "CPU"),
                   events.BlockStored([H[2]], None, [1, 2, 3, 4], 4, None, "CPU", None)]
    assert m.announced == {H[2]}
    assert m.withdraw_all() == [events.BlockRemoved([H[2]], "CPU")]
    assert m.withdraw_all() == []


def test_mapper_int_hashes_like_vllm():
    m = events.VllmEventMapper(4, int_block_hashes=True)
    h = bytes(range(32))
    out = m.on_records([srec(1, h, parent=H[5])])
    assert out[0].block_hashes == [int.from_bytes(h, "big") & (2**64 - 1)]
    assert out[0].parent_block_hash == int.from_bytes(H[5][-8:], "big")


# ------------------------------------------------------------------ wire format
class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's examples/online_serving/kv_events_subscriber.py types (copied field lists)."""

    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldKVBatch(OldBatch):
    events: list[OldStored | OldRemoved | OldCleared]


class NewEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM after PR #42892: events are tagged maps (the batch stays positional)."""


class NewStored(NewEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class NewRemoved(NewEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class NewCleared(NewEvent, tag="AllBlocksCleared"):
    pass


class NewBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[NewStored | NewRemoved | NewCleared]
    data_parallel_rank: int | None = None


def sample_batch() -> events.VllmKVEventBatch:
    return events.VllmKVEventBatch(ts=12.5, data_parallel_rank=0, events=[
        events.BlockStored([H[1]], H[0], [7, 8], 2, None, "CPU", None),
        events.BlockRemoved([H[1], 5], "CPU"),
        events.AllBlocksCleared(),
    ])


def test_array_wire_is_vllm_positional():
    payload = events.encode_vllm_batch(sample_batch())
    raw = dec(payload)
    assert raw == [12.5, [["BlockStored", [H[1]], H[0], [7, 8], 2, None, "CPU", None],
                          ["BlockRemoved", [H[1], 5], "CPU"], ["AllBlocksCleared"]], 0]
    assert events.decode_vllm_batch(payload) == sample_batch()
    old = msgspec.msgpack.decode(payload, type=OldKVBatch)  # vLLM's example subscriber
    assert old.events[0] == OldStored([H[1]], H[0], [7, 8], 2, None, "CPU")
    assert old.events[1] == OldRemoved([H[1], 5], "CPU") and old.ts == 12.5


def test_map_wire_is_vllm_after_42892():
    payload = events.encode_vllm_batch(sample_batch(), "map")
    new = msgspec.msgpack.decode(payload, type=NewBatch)
    assert new.events[0] == NewStored([H[1]], H[0], [7, 8], 2, None, "CPU", None)
    assert new.events[1] == NewRemoved([H[1], 5], "CPU")
    assert isinstance(new.events[2], NewCleared) and new.data_parallel_rank == 0
    with pytest.raises(errors.InvalidArgumentError):
        events.encode_vllm_batch(sample_batch(), "json")  # type: ignore[arg-type]


def test_zmq_publisher_pub_frames_and_replay():
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = events.VllmZmqPublisher(pub_ep, replay_endpoint=rep_ep, topic="kv-events",
                                  buffer_steps=2)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        sub.connect(pub_ep)
        dealer.connect(rep_ep)
        time.sleep(0.3)
        seqs = [pub.publish(sample_batch()) for _ in range(3)]
        assert seqs == [0, 1, 2]
        frames = [sub.recv_multipart() for _ in range(3)]
        assert [f[0] for f in frames] == [b"kv-events"] * 3
        assert [f[1] for f in frames] == [i.to_bytes(8, "big") for i in range(3)]
        assert all(events.decode_vllm_batch(f[2]) == sample_batch() for f in frames)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        deadline = time.monotonic() + 3
        while pub.service_replay(0.05) == 0:
            assert time.monotonic() < deadline
        got = []
        while True:
            assert dealer.poll(2000)
            _, seq, payload = dealer.recv_multipart()
            got.append((seq, payload))
            if not payload:
                break
        # buffer_steps=2: seqs 1 and 2 remain; then vLLM's end marker (-1, b"")
        assert [s for s, _ in got] == [(1).to_bytes(8, "big"), (2).to_bytes(8, "big"),
                                       (-1).to_bytes(8, "big", signed=True)]
        assert got[0][1] == frames[1][2]
        with pytest.raises(errors.KVCacheSDKError, match="bind"):
            events.VllmZmqPublisher(pub_ep)  # in use
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        pub.close()
    with pytest.raises(errors.ContextClosedError):
        pub.publish(sample_batch())


# ------------------------------------------------------------------ CLI
def test_cli_bad_arguments_and_unreachable_server():
    assert events.events_main(["--url", "tcp://127.0.0.1:1"]) == 2  # missing options
    assert events.events_main(["--url", "x", "--http-url", "http://127.0.0.1:1",
                               "--model", "m"]) == 2
    t0 = time.monotonic()
    assert events.events_main(["--url", "tcp://127.0.0.1:1", "--http-url",
                               f"http://127.0.0.1:{free_port()}", "--model", "m",
                               "--timeout", "1"]) == 1
    assert time.monotonic() - t0 < 5
