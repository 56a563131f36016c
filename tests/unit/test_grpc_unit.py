"""gRPC control plane without a server: URLs, the per-generation codec, error mapping and the
committed descriptor sets (tests/integration/test_grpc.py runs it against real servers)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from lmcache_kv_fast.errors import (
    ConnectionLostError,
    InvalidArgumentError,
    KVCacheSDKError,
    ProtocolError,
    ServerError,
    ServerTimeoutError,
)
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.keys import make_key
from lmcache_kv_fast.protocol.mp_config import require_transport
from lmcache_kv_fast.protocol.ops import GEN_053, GEN_056, GEN_057, Op
from lmcache_kv_fast.protocol.types import (
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
)
from lmcache_kv_fast.transport.urls import parse_control_url, parse_grpc_url

pytest.importorskip("google.protobuf")
from lmcache_kv_fast.transport import grpc_codec


# -- URLs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("url,target,transport", [
    ("grpc://127.0.0.1:5555", "127.0.0.1:5555", "grpc"),
    ("grpc://lmcache.svc.local:80", "lmcache.svc.local:80", "grpc"),
    ("grpc://[::1]:7000", "[::1]:7000", "grpc"),
    ("grpc+unix:///run/lmcache/mp.sock", "unix:///run/lmcache/mp.sock", "grpc"),
])
def test_grpc_urls(url, target, transport):
    ep = parse_control_url(url)
    assert ep.grpc_target == target and ep.transport == transport
    assert ep.url == url


@pytest.mark.parametrize("url,why", [
    ("grpc://127.0.0.1", "port is missing"),
    ("grpc://127.0.0.1:0", "not in 1..65535"),
    ("grpc://*:5555", "wildcard"),
    ("grpc://host:5555/path", "no path"),
    ("grpc://host:5555\n", "newline"),
    ("grpc+unix://relative.sock", "must be absolute"),
    ("grpc+unix:///", "must be absolute"),
    ("grpc+unix:///" + "x" * 200, "longer than"),
    ("grpcs://host:1", "scheme must be"),
])
def test_bad_grpc_urls(url, why):
    with pytest.raises(InvalidArgumentError, match=why) as ei:
        parse_control_url(url)
    assert str(ei.value).startswith("url must look like")


def test_control_url_keeps_zmq_forms():
    assert parse_control_url("tcp://127.0.0.1:5555").transport == "zmq"
    assert parse_control_url("ipc:///tmp/x").transport == "zmq"
    with pytest.raises(InvalidArgumentError, match="grpc://host:port"):
        parse_control_url("localhost:5555")
    with pytest.raises(InvalidArgumentError, match="must look like 'grpc://"):
        parse_grpc_url("tcp://127.0.0.1:5555")


def test_require_transport_names_both():
    require_transport({"transport": "grpc"}, "http://h:1", "grpc://h:2", "grpc")
    require_transport({}, "http://h:1", "tcp://h:2", "zmq")  # before 0.5.5: always zmq
    with pytest.raises(KVCacheSDKError, match="serves transport 'grpc'.*zmq URL.*grpc://"):
        require_transport({"transport": "grpc"}, "http://h:1", "tcp://h:2", "zmq")
    with pytest.raises(KVCacheSDKError, match="serves transport 'zmq'.*grpc URL.*tcp://"):
        require_transport({"transport": "zmq"}, "http://h:1", "grpc://h:2", "grpc")


# -- codec ---------------------------------------------------------------------------------
def _key(gen, **kw):
    return make_key(gen, model_name="m", world_size=1, worker_id=kw.pop("worker_id", None),
                    tokens=[1, 2, 70000], start=0, end=3, request_id="r", **kw)


def test_dialects_are_separate_pools():
    d6, d7 = grpc_codec.dialect_for(GEN_056), grpc_codec.dialect_for(GEN_057)
    key6 = d6.method(Op.LOOKUP).request.DESCRIPTOR.fields_by_name["key"].message_type
    key7 = d7.method(Op.LOOKUP).request.DESCRIPTOR.fields_by_name["key"].message_type
    assert key6.full_name == key7.full_name == "lmcache.mp.IpcCacheServerKey"
    assert "token_ids" in key6.fields_by_name and "token_bytes" in key7.fields_by_name
    assert d6.method(Op.NOOP).path == "/lmcache.mp.DebugService/Noop"
    assert d7.method(Op.NOOP).path == "/lmcache.mp.ManagementService/Noop"
    assert d6.method(Op.SUBSCRIBE_KV_EVENTS).streaming
    with pytest.raises(KeyError, match="negotiate_chunk_size"):
        d6.method(Op.NEGOTIATE_CHUNK_SIZE)
    with pytest.raises(KVCacheSDKError, match="0.5.6 and 0.5.7 only"):
        grpc_codec.dialect_for(GEN_053)


@pytest.mark.parametrize("gen", [GEN_056, GEN_057])
def test_key_and_trailing_payloads(gen):
    d = grpc_codec.dialect_for(gen)
    key = _key(gen, worker_id=0, cache_salt="s", request_configs={"a": 1})
    m = d.method(Op.PREPARE_STORE)
    msg = m.encode(gen.payloads(Op.PREPARE_STORE, [key, 7]))
    k = msg.key
    assert (k.model_name, k.world_size, k.start, k.end, k.request_id, k.cache_salt) == \
        ("m", 1, 0, 3, "r", "s")
    assert k.HasField("worker_id") and k.worker_id == 0
    assert msgspec.msgpack.decode(k.encoded_request_configs) == {"a": 1}
    assert msg.instance_id == 7
    if gen is GEN_057:
        assert k.token_bytes == (1).to_bytes(4, "big") + (2).to_bytes(4, "big") + \
            (70000).to_bytes(4, "big")
        assert list(msg.skipped_chunks) == []
    else:
        assert list(k.token_ids) == [1, 2, 70000]
    # a round trip through the wire bytes
    again = m.request.FromString(msg.SerializeToString())
    assert again == msg


def test_optional_fields_stay_unset():
    d = grpc_codec.dialect_for(GEN_057)
    msg = d.method(Op.LOOKUP).encode([_key(GEN_057), 1])
    assert not msg.key.HasField("worker_id")
    assert not msg.key.HasField("encoded_request_configs")
    ping = d.method(Op.PING).encode([None])
    assert not ping.HasField("instance_id")
    free = d.method(Op.FREE_LOOKUP_LOCKS).encode([_key(GEN_057), 1, [(0, 256), (512, 768)]])
    assert [(r.start, r.end) for r in free.extra_ranges] == [(0, 256), (512, 768)]


def test_register_payload_and_reply():
    for gen in (GEN_056, GEN_057):
        m = grpc_codec.dialect_for(gen).method(Op.REGISTER_ENGINE_DRIVEN)
        p = RegisterEngineDrivenContextPayload(
            instance_id=5, model_name="m", world_size=1, block_size=16, num_layers=2,
            hidden_dim_size=128, dtype_str="bfloat16", use_mla=False, num_physical_slots=None)
        msg = m.encode([p])
        assert msg.hidden_dim_size == 128 and not msg.HasField("num_physical_slots")
        reply = m.response(shm_name="pool", pool_size=1 << 20)
        got = grpc_codec.to_type(m.decode(reply), RegisterEngineDrivenContextResponse, "r")
        assert (got.shm_name, got.pool_size, got.null_block_id) == ("pool", 1 << 20, 0)


def test_commit_store_data_comes_out_of_the_bin_frame():
    m = grpc_codec.dialect_for(GEN_056).method(Op.COMMIT_STORE)
    for payload in (b"", b"x" * 300, b"y" * 70000):
        msg = m.encode([_key(GEN_056), 3], raw=[codec.encode(payload)])
        assert msg.data == payload
    with pytest.raises(ProtocolError, match="msgpack bin"):
        grpc_codec.payload_of_raw(codec.encode("text"))
    with pytest.raises(ProtocolError, match="bin header says"):
        grpc_codec.payload_of_raw(codec.encode(b"abc")[:-1])


def test_replies_decode_like_zmq_frames():
    d = grpc_codec.dialect_for(GEN_057)
    ps = d.method(Op.PREPARE_STORE)
    slot = {"offset": 0, "length": 64, "shape": [2, 1, 4, 4], "dtype": "bfloat16"}
    ctx = {"slots": [slot], "chunk_indices": [0]}
    got = grpc_codec.to_type(ps.decode(ps.response(encoded_context=codec.encode(ctx))),
                             PrepareStoreResponse, "prepare_store")
    assert got.context.slots[0].length == 64 and got.context.chunk_indices == [0]
    empty = grpc_codec.to_type(ps.decode(ps.response()), PrepareStoreResponse, "p")
    assert empty.context.slots == []
    pr = d.method(Op.PREPARE_RETRIEVE)
    r = grpc_codec.to_type(pr.decode(pr.response(success=True, data=b"abc")),
                           PrepareRetrieveResponse, "prepare_retrieve")
    assert r.success and bytes(r.data) == b"abc" and r.context.slots == []
    w = d.method(Op.WAIT_PREFETCH_STATUS)
    assert w.decode(w.response()) is None
    assert grpc_codec.to_type(w.decode(w.response(chunk_count=0)), int | None, "w") == 0
    assert d.method(Op.LOOKUP).decode(d.method(Op.LOOKUP).response()) is None
    # strict: a reply that does not fit the flow's type is a protocol error
    with pytest.raises(ProtocolError, match="expected"):
        grpc_codec.to_type(ps.decode(ps.response(encoded_context=codec.encode(
            {"slots": [{"offset": "x"}]}))), PrepareStoreResponse, "prepare_store")
    with pytest.raises(ProtocolError, match="msgpack map"):
        ps.decode(ps.response(encoded_context=codec.encode([1, 2])))


def test_kv_event_batch_decodes():
    from lmcache_kv_fast.protocol.types import WireKVEventBatch

    for gen in (GEN_056, GEN_057):
        m = grpc_codec.dialect_for(gen).method(Op.SUBSCRIBE_KV_EVENTS)
        batch = m.response(enabled=True, incarnation=3, next_cursor=9)
        ev = batch.events.add(seq=8, kind="stored", medium="CPU", model_name="m")
        ev.block_hashes.append(b"h" * 16)
        ev.token_ids.extend([1, 2])
        got = grpc_codec.to_type(m.decode(batch), WireKVEventBatch, "events")
        assert got.next_cursor == 9 and got.events[0].parent_block_hash is None
        assert got.events[0].block_hashes == [b"h" * 16] and got.events[0].token_ids == [1, 2]


# -- errors --------------------------------------------------------------------------------
class _Status:
    """What grpc.RpcError carries (code() / details()); no server involved."""

    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_status_codes_become_sdk_errors():
    grpc = pytest.importorskip("grpc")
    from lmcache_kv_fast.transport.grpc_client import GrpcClient

    client = GrpcClient("grpc://127.0.0.1:9", GEN_057, 1.0)  # nothing is contacted
    try:
        sc = grpc.StatusCode
        e = client.rpc_error(Op.LOOKUP, _Status(sc.UNKNOWN, "Exception calling application: x"))
        assert isinstance(e, ServerError) and e.code == "UNKNOWN" and "application: x" in str(e)
        e = client.rpc_error(Op.PREPARE_STORE, _Status(sc.UNIMPLEMENTED, "not enabled"))
        assert isinstance(e, ServerError) and "--supported-transfer-mode" in str(e)
        e = client.rpc_error(Op.NOOP, _Status(sc.UNAVAILABLE, "Connection reset"))
        assert isinstance(e, ConnectionLostError) and "reconnect" in str(e)
        e = client.rpc_error(Op.NOOP, _Status(sc.DEADLINE_EXCEEDED, ""))
        assert isinstance(e, ServerTimeoutError) and not isinstance(e, ConnectionLostError)
        e = client.rpc_error(Op.NOOP, _Status(sc.INTERNAL, "Exception deserializing"))
        assert isinstance(e, ServerError) and "INTERNAL" in str(e)
    finally:
        client.close()


# -- the committed descriptor sets match the .proto files ---------------------------------
_MSG = re.compile(r"^message (\w+) \{(.*?)\}", re.S | re.M)  # no nested braces in these
_FIELD = re.compile(r"^\s*(optional |repeated )?([\w.]+) (\w+) = (\d+);", re.M)
_RPC = re.compile(r"rpc (\w+)\(\s*(\w+)\)\s*returns \((stream )?(\w+)\)", re.S)


@pytest.mark.parametrize("tag", ["v056", "v057"])
def test_descriptor_sets_match_proto_files(tag):
    from google.protobuf import descriptor_pb2

    fds = descriptor_pb2.FileDescriptorSet.FromString(
        (grpc_codec.PROTO_DIR / f"{tag}.binpb").read_bytes())
    protos = sorted(p.name for p in (grpc_codec.PROTO_DIR / tag).glob("*.proto"))
    assert sorted(f.name for f in fds.file) == protos
    by_name = {f.name: f for f in fds.file}
    for name in protos:
        text = Path(grpc_codec.PROTO_DIR / tag / name).read_text()
        assert text.startswith("// SPDX-License-Identifier: Apache-2.0")
        fd = by_name[name]
        msgs = {m.name: m for m in fd.message_type}
        parsed = _MSG.findall(text)
        assert sorted(msgs) == sorted(n for n, _ in parsed)
        for mname, body in parsed:
            want = {(f[2], int(f[3])) for f in _FIELD.findall(body)}
            assert {(f.name, f.number) for f in msgs[mname].field} == want, mname
        rpcs = {(m.name, m.input_type.rsplit(".", 1)[-1], m.server_streaming,
                 m.output_type.rsplit(".", 1)[-1])
                for s in fd.service for m in s.method}
        assert rpcs == {(r[0], r[1], bool(r[2]), r[3]) for r in _RPC.findall(text)}
