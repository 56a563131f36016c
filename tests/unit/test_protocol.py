"""Wire encoding matches the frames captured from the real server (docs/protocol.md §2.8)."""

from __future__ import annotations

import struct

import msgspec
import pytest

from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.detect import MP_KEYS_051, detect_generation
from lmcache_kv_fast.protocol.ops import (
    GEN_051,
    GEN_053,
    GEN_055,
    GEN_056,
    GENERATIONS,
    NEWEST,
    Op,
)
from lmcache_kv_fast.protocol.types import (
    IPCCacheServerKey,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
)


def test_key_frame_matches_capture():
    key = IPCCacheServerKey(model_name="m", world_size=1, worker_id=0, token_ids=[1, 2], start=0,
                            end=2, request_id="r", cache_salt="", num_kv_readers=1)
    assert codec.encode(key).hex() == (
        "8aaa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501a9776f726b65725f696400a9746f6b656e"
        "5f696473920102a5737461727400a3656e6402aa726571756573745f6964a172aa63616368655f73616c74"
        "a0af726571756573745f636f6e66696773c0ae6e756d5f6b765f7265616465727301")


@pytest.mark.parametrize("op, hex_", [(Op.NOOP, "18"), (Op.GET_CHUNK_SIZE, "15"), (Op.PING, "16"),
                                      (Op.END_SESSION, "0d"), (Op.WAIT_PREFETCH_STATUS, "0a"),
                                      (Op.CLEAR, "14")])
def test_op_ids_056(op, hex_):
    assert codec.encode(GEN_056.op_frame_value(op)).hex() == hex_


def test_named_only_ops():
    assert GEN_056.op_frame_value(Op.SUBSCRIBE_KV_EVENTS) == "subscribe_kv_events"
    for gen in (GEN_051, GEN_053, GEN_055):
        assert not gen.supports(Op.SUBSCRIBE_KV_EVENTS)
        with pytest.raises(KeyError):
            gen.op_frame_value(Op.SUBSCRIBE_KV_EVENTS)


def test_old_ids_shifted_by_three():
    for op, old in GEN_051.op_ids.items():
        new = GEN_053.op_ids[op]
        assert new == old if old <= 2 else new == old + 3, op


def test_no_generation_reuses_retired_id_11_except_old():
    for gen in GENERATIONS:
        if gen is not GEN_051:
            assert 11 not in gen.op_ids.values()


def test_uid_and_ping_frames():
    assert codec.encode(2**40).hex() == "cf0000010000000000"
    assert codec.encode(-1).hex() == "ff"
    assert codec.encode(None).hex() == "c0"
    assert codec.encode(12345).hex() == "cd3039"
    assert codec.encode(b"").hex() == "c400"


def test_registration_payload_is_a_map():
    p = RegisterEngineDrivenContextPayload(instance_id=19492455605317536, model_name="spec-model",
                                           world_size=1, block_size=16, num_layers=4,
                                           hidden_dim_size=1024, dtype_str="bfloat16",
                                           use_mla=False, num_physical_slots=256)
    d = msgspec.msgpack.decode(codec.encode(p))
    assert d == {"instance_id": 19492455605317536, "model_name": "spec-model", "world_size": 1,
                 "block_size": 16, "num_layers": 4, "hidden_dim_size": 1024,
                 "dtype_str": "bfloat16", "use_mla": False, "num_physical_slots": 256}


def test_decode_replies():
    raw = msgspec.msgpack.encode({"shm_name": "lmcache_l1_pool_x", "pool_size": 1 << 30})
    r = codec.decode(raw, RegisterEngineDrivenContextResponse, what="reg")
    assert r.shm_name == "lmcache_l1_pool_x" and r.pool_size == 1 << 30
    ps = codec.decode(msgspec.msgpack.encode({"context": {"slots": [
        {"offset": 0, "length": 4194304, "shape": [2, 4, 256, 1024], "dtype": "bfloat16"}],
        "chunk_indices": [0]}}), PrepareStoreResponse, what="ps")
    assert ps.context.slots[0].length == 4194304 and ps.context.chunk_indices == [0]
    assert codec.decode(msgspec.msgpack.encode({"context": {}}), PrepareStoreResponse,
                        what="ps").context.slots == []
    miss = codec.decode(msgspec.msgpack.encode({"success": False, "data": b"", "context": {}}),
                        PrepareRetrieveResponse, what="pr")
    assert miss.success is False


@pytest.mark.parametrize("bad", [b"\xc1", msgspec.msgpack.encode({"context": {"slots": "x"}}),
                                 msgspec.msgpack.encode([1, 2])])
def test_decode_refuses_malformed(bad):
    with pytest.raises(ProtocolError):
        codec.decode(bad, PrepareStoreResponse, what="prepare_store")


@pytest.mark.parametrize("version, mp, want", [
    ("0.5.6-g3e11e108", {}, GEN_056),
    ('"0.5.6"', {}, GEN_056),
    (None, {"transport": "zmq", "enable": True, "chunk_size": 256}, GEN_055),
    (None, {"enable": True, "chunk_size": 256}, GEN_053),
    (None, dict.fromkeys(MP_KEYS_051), GEN_051),  # the real 0.5.1/0.5.2 key set
    ("0.5.2", {}, GEN_051),
    ("0.5.4", {}, GEN_053),
])
def test_detect_generation(version, mp, want):
    gen, verify = detect_generation(version, mp)
    assert gen is want and verify is False


def test_detect_newer_is_tried_with_verification():
    gen, verify = detect_generation("0.6.0", {})
    assert gen is NEWEST and verify is True


@pytest.mark.parametrize("version, mp", [("0.4.9", {}), ("garbage", {}),
                                         (None, {f"k{i}": i for i in range(40)})])
def test_detect_unrecognisable(version, mp):
    with pytest.raises(KVCacheSDKError):
        detect_generation(version, mp)


def test_key_057_packs_tokens_big_endian():
    from lmcache_kv_fast.protocol.keys import make_key, pack_tokens, token_list
    from lmcache_kv_fast.protocol.ops import GEN_057

    toks = [0, 1, 258, 2**32 - 1]
    key = make_key(GEN_057, model_name="m", world_size=1, worker_id=0, tokens=toks, start=0,
                   end=4, request_id="r")
    frame = codec.decode(codec.encode(key), dict, what="key")
    # the server's field order (mp/custom_types.py IPCCacheServerKey), token_bytes not token_ids
    assert list(frame) == ["model_name", "world_size", "worker_id", "token_bytes", "start",
                           "end", "request_id", "cache_salt", "request_configs",
                           "num_kv_readers"]
    assert frame["token_bytes"] == struct.pack(">4I", *toks) == pack_tokens(toks)
    assert token_list(key) == toks
    old = make_key(GEN_056, model_name="m", world_size=1, worker_id=0, tokens=toks, start=0,
                   end=4, request_id="r")
    assert isinstance(old, IPCCacheServerKey) and token_list(old) == toks
    with pytest.raises(OverflowError):
        pack_tokens([2**32])
