"""Server-generation detection and op tables, against what the real servers 0.5.1 .. 0.5.7rc2 show.

The literal ``mp`` dicts below are ``GET /config`` of each real server (CPU, pickle plane,
``--supported-transfer-mode auto``), captured with ``testbed.compat``; the
``/version`` strings too (every version has ``/version``, not only 0.5.6). The op numbers are
each version's ``RequestType`` enum values (0.5.1 .. 0.5.5) and 0.5.6's frozen legacy table.
"""

from __future__ import annotations

import pytest

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.protocol.detect import MP_KEYS_056, MP_KEYS_057, detect_generation
from lmcache_kv_fast.protocol.ops import (
    GEN_051,
    GEN_053,
    GEN_055,
    GEN_056,
    GEN_057,
    GENERATIONS,
    NEWEST,
    Generation,
    Op,
    generation_for,
    parse_version,
)

_P2P = {"advertise_url": "", "listen_url": "", "lookup_timeout": 30.0, "load_timeout": 30.0,
        "transfer_engine": "nixl"}
_PLUGINS = {"locations": [], "extra_config": {}}

#: GET /version "0.5.1-g979719d7"; GET /config "mp" (18 keys)
MP_051 = {
    "host": "127.0.0.1", "port": 56063, "chunk_size": 256, "max_workers": 1,
    "max_gpu_workers": 1, "max_cpu_workers": 1, "hash_algorithm": "blake3",
    "engine_type": "default", "separate_object_groups": True, "enable_segmented_prefix": False,
    "supported_transfer_mode": "auto", "runtime_plugin_config": _PLUGINS, "p2p_config": _P2P,
    "shm_name": "", "script_allowed_imports": [],
    "instance_id": "a1345401-f7ae-4a3b-873d-374e3aed025a",
    "worker_reap_timeout_seconds": 120.0, "worker_registration_grace_seconds": 3600.0,
}
#: GET /version "0.5.2-gcd2c0d6a"; GET /config "mp" (18 keys)
MP_052 = {
    "host": "127.0.0.1", "port": 51591, "chunk_size": 256, "max_workers": 1,
    "max_gpu_workers": 1, "max_cpu_workers": 1, "hash_algorithm": "blake3",
    "engine_type": "default", "separate_object_groups": True, "enable_segmented_prefix": False,
    "supported_transfer_mode": "auto", "runtime_plugin_config": _PLUGINS, "p2p_config": _P2P,
    "shm_name": "", "script_allowed_imports": [],
    "instance_id": "5cb88788-085f-4f5e-a5f0-958323db4dee",
    "worker_reap_timeout_seconds": 120.0, "worker_registration_grace_seconds": 3600.0,
}
#: GET /version "0.5.3-g140819c9"; GET /config "mp" (19 keys)
MP_053 = {
    "host": "127.0.0.1", "port": 39203, "chunk_size": 256, "max_workers": 1,
    "max_gpu_workers": 1, "max_cpu_workers": 1, "hash_algorithm": "blake3",
    "engine_type": "default", "separate_object_groups": False,
    "enable_segmented_prefix": False, "supported_transfer_mode": "auto",
    "runtime_plugin_config": _PLUGINS, "p2p_config": _P2P, "shm_name": "",
    "script_allowed_imports": [], "instance_id": "44582491-0065-4b9c-aa2f-33b5b45ccb6e",
    "worker_reap_timeout_seconds": 120.0, "worker_registration_grace_seconds": 3600.0,
    "enable": [],
}
#: GET /version "0.5.4-g3e11b8ed"; GET /config "mp" (19 keys)
MP_054 = {
    "host": "127.0.0.1", "port": 59669, "chunk_size": 256, "max_workers": 1,
    "max_gpu_workers": 1, "max_cpu_workers": 1, "hash_algorithm": "blake3",
    "engine_type": "default", "separate_object_groups": False,
    "enable_segmented_prefix": False, "supported_transfer_mode": "auto",
    "runtime_plugin_config": _PLUGINS, "p2p_config": _P2P, "shm_name": "",
    "script_allowed_imports": [], "instance_id": "a67b6682-47a7-4cef-a376-f2b9b94b718a",
    "worker_reap_timeout_seconds": 120.0, "worker_registration_grace_seconds": 3600.0,
    "enable": [],
}
#: GET /version "0.5.5-g05a013b2"; GET /config "mp" (22 keys)
MP_055 = {
    "transport": "zmq", "host": "127.0.0.1", "port": 34927, "chunk_size": 256,
    "max_workers": 1, "max_gpu_workers": 1, "max_cpu_workers": 1, "hash_algorithm": "blake3",
    "engine_type": "default", "separate_object_groups": False,
    "enable_segmented_prefix": False, "enable_dedup_content": False,
    "supported_transfer_mode": "auto", "isolated_ipc": False,
    "runtime_plugin_config": _PLUGINS, "p2p_config": _P2P, "shm_name": "",
    "script_allowed_imports": [], "instance_id": "ca6dbf89-cae8-483b-99f5-248ad2379214",
    "worker_reap_timeout_seconds": 120.0, "worker_registration_grace_seconds": 3600.0,
    "enable": [],
}
#: GET /version "0.5.6-g3e11e108"; GET /config "mp" (29 keys)
MP_056 = {
    "transport": "zmq", "host": "127.0.0.1", "port": 33769, "chunk_size": 256,
    "max_workers": 1, "max_gpu_workers": 1, "max_cpu_workers": 1, "grpc_server_workers": 32,
    "hash_algorithm": "blake3", "engine_type": "default", "separate_object_groups": False,
    "enable_segmented_prefix": False, "enable_dedup_content": False,
    "enable_blend_reorder": False, "supported_transfer_mode": "auto", "isolated_ipc": False,
    "runtime_plugin_config": _PLUGINS, "p2p_config": _P2P, "shm_name": "",
    "script_allowed_imports": [], "run_script_api_enabled": False,
    "instance_id": "8a3fd7b1-bfe9-4328-b793-e502dd4a6c76",
    "worker_reap_timeout_seconds": 120.0, "session_ttl_seconds": 600.0,
    "worker_registration_grace_seconds": 3600.0, "enable": [], "kv_event_log_size": 32768,
    "null_block_id": 0, "server_modules": [],
}
#: GET /version "0.5.7rc2-gbf85b41f"; GET /config "mp" (31 keys: "enable" gone, three new)
MP_057 = {
    "transport": "zmq", "host": "127.0.0.1", "port": 42411, "chunk_size": 256,
    "max_workers": 1, "max_gpu_workers": 1, "max_cpu_workers": 1, "grpc_server_workers": 32,
    "grpc_server_mode": "sync", "api_key_files": [], "hash_algorithm": "blake3",
    "engine_type": "default", "separate_object_groups": False,
    "enable_segmented_prefix": False, "enable_dedup_content": False,
    "enable_blend_reorder": False, "supported_transfer_mode": "auto", "isolated_ipc": False,
    "runtime_plugin_config": _PLUGINS, "p2p_config": _P2P, "shm_name": "",
    "script_allowed_imports": [], "run_script_api_enabled": False,
    "instance_id": "9ca991ab-ec67-4b3c-ada5-08f181a350e3",
    "worker_reap_timeout_seconds": 120.0, "session_ttl_seconds": 600.0,
    "kv_load_policy": "DEFAULT", "worker_registration_grace_seconds": 3600.0,
    "kv_event_log_size": 32768, "null_block_id": 0, "server_modules": [],
}

#: version -> (its GET /version, its /config "mp", its generation)
OBSERVED: dict[str, tuple[str, dict, Generation]] = {
    "0.5.1": ("0.5.1-g979719d7", MP_051, GEN_051),
    "0.5.2": ("0.5.2-gcd2c0d6a", MP_052, GEN_051),
    "0.5.3": ("0.5.3-g140819c9", MP_053, GEN_053),
    "0.5.4": ("0.5.4-g3e11b8ed", MP_054, GEN_053),
    "0.5.5": ("0.5.5-g05a013b2", MP_055, GEN_055),
    "0.5.6": ("0.5.6-g3e11e108", MP_056, GEN_056),
    "0.5.7": ("0.5.7rc2-gbf85b41f", MP_057, GEN_057),
}

#: RequestType values of the ops the SDK sends: 0.5.1/0.5.2 enum order, and from 0.5.3 on
#: (three q-cache ops inserted at 3..5) the numbering 0.5.6 froze as its legacy table.
IDS_051 = {
    Op.REGISTER_KV_CACHE: 1, Op.UNREGISTER_KV_CACHE: 2, Op.LOOKUP: 5,
    Op.QUERY_PREFETCH_STATUS: 6, Op.WAIT_PREFETCH_STATUS: 7, Op.FREE_LOOKUP_LOCKS: 9,
    Op.END_SESSION: 10, Op.REGISTER_ENGINE_DRIVEN: 11, Op.UNREGISTER_ENGINE_DRIVEN: 12,
    Op.PREPARE_STORE: 13, Op.COMMIT_STORE: 14, Op.PREPARE_RETRIEVE: 15, Op.COMMIT_RETRIEVE: 16,
    Op.CLEAR: 17, Op.GET_CHUNK_SIZE: 18, Op.PING: 19, Op.NOOP: 21,
}
IDS_053 = {
    Op.REGISTER_KV_CACHE: 1, Op.UNREGISTER_KV_CACHE: 2, Op.LOOKUP: 8,
    Op.QUERY_PREFETCH_STATUS: 9, Op.WAIT_PREFETCH_STATUS: 10, Op.FREE_LOOKUP_LOCKS: 12,
    Op.END_SESSION: 13, Op.REGISTER_ENGINE_DRIVEN: 14, Op.UNREGISTER_ENGINE_DRIVEN: 15,
    Op.PREPARE_STORE: 16, Op.COMMIT_STORE: 17, Op.PREPARE_RETRIEVE: 18, Op.COMMIT_RETRIEVE: 19,
    Op.CLEAR: 20, Op.GET_CHUNK_SIZE: 21, Op.PING: 22, Op.NOOP: 24,
}
#: Ops the SDK's flows send (handshake, lookup, store, retrieve, heartbeat, close, clear).
SDK_OPS = frozenset(IDS_051)


@pytest.mark.parametrize("version", sorted(OBSERVED))
def test_detect_by_version_endpoint(version):
    ver, mp, want = OBSERVED[version]
    assert detect_generation(ver, mp) == (want, False)
    assert detect_generation(f'"{ver}"', {}) == (want, False)  # raw JSON string, no keys


@pytest.mark.parametrize("version", sorted(OBSERVED))
def test_detect_by_config_keys_without_version(version):
    _, mp, want = OBSERVED[version]
    assert detect_generation(None, mp) == (want, False)


@pytest.mark.parametrize("version", sorted(OBSERVED))
def test_garbage_version_falls_back_to_config_keys(version):
    _, mp, want = OBSERVED[version]
    assert detect_generation("unknown", mp) == (want, False)


def test_key_sets_are_what_the_detector_knows():
    assert len(MP_051) == len(MP_052) == 18 and set(MP_051) == set(MP_052)
    assert set(MP_053) == set(MP_054) == set(MP_051) | {"enable"}
    assert set(MP_055) == set(MP_053) | {"transport", "isolated_ipc", "enable_dedup_content"}
    assert set(MP_056) == MP_KEYS_056 and len(MP_056) == 29
    # 0.5.6 also has "transport": the old `"transport" in keys => 0.5.5` rule misread it
    assert "transport" in MP_056
    assert set(MP_057) == MP_KEYS_057 and len(MP_057) == 31 and "enable" not in MP_057


def test_newer_server_tries_newest_with_verification():
    assert detect_generation("0.5.8-gdeadbee", {}) == (NEWEST, True)
    assert detect_generation("0.6.0", MP_056) == (NEWEST, True)
    assert detect_generation("0.5.8.dev3+gabc", {}) == (NEWEST, True)
    # a 0.5.7 pre-release or dev build is 0.5.7
    assert detect_generation("0.5.7.dev3+gabc", {}) == (GEN_057, False)
    # no /version, but 0.5.7's keys plus new ones: a newer generation
    assert detect_generation(None, MP_057 | {"some_new_knob": 1}) == (NEWEST, True)


@pytest.mark.parametrize("version, mp, shown", [
    ("0.4.9", {}, "0.4.9"),
    ("0.5.0-gabc", MP_051, "0.5.0-gabc"),
    ("garbage", {}, "garbage"),
    (None, {"chunk_size": 256}, "chunk_size"),
    (None, {f"k{i}": i for i in range(40)}, "k0"),
])
def test_unrecognisable_is_a_clear_error(version, mp, shown):
    with pytest.raises(KVCacheSDKError, match=shown):
        detect_generation(version, mp)


@pytest.mark.parametrize("version", sorted(OBSERVED))
def test_generation_for_real_version_strings(version):
    ver, _, want = OBSERVED[version]
    assert generation_for(ver) is want
    assert generation_for(version) is want
    assert version in want.versions


def test_parse_version():
    assert parse_version("0.5.6-g3e11e108") == (0, 5, 6)
    assert parse_version('"0.5.1"') == (0, 5, 1)
    assert parse_version("v0.5.4.post1") == (0, 5, 4)
    assert parse_version("0.5.7.dev3+gabc") == (0, 5, 7)
    assert parse_version("garbage") is None
    assert parse_version("7") is None
    assert generation_for("0.5.4.post1") is GEN_053


@pytest.mark.parametrize("gen, ids", [(GEN_051, IDS_051), (GEN_053, IDS_053),
                                      (GEN_055, IDS_053), (GEN_056, IDS_053),
                                      (GEN_057, IDS_053)])
def test_op_tables_match_the_servers(gen, ids):
    for op in SDK_OPS:
        assert gen.supports(op), (gen.name, op)
        assert gen.op_frame_value(op) == ids[op], (gen.name, op)
    # every integer a generation can send is one of that server's own SDK-op numbers
    assert {gen.op_frame_value(op) for op in gen.op_ids} <= set(ids.values())


def test_names_only_where_the_server_decodes_them():
    # 0.5.1 .. 0.5.5 decode the op frame as an int enum: a string op frame raises in their
    # ZMQ loop *outside* any handler and kills it for good (observed on each real server).
    for gen in (GEN_051, GEN_053, GEN_055):
        assert not gen.named_ops
        for op in Op:
            if gen.supports(op):
                assert isinstance(gen.op_frame_value(op), int)
            else:
                with pytest.raises(KeyError):
                    gen.op_frame_value(op)
    assert GEN_056.op_frame_value(Op.SUBSCRIBE_KV_EVENTS) == "subscribe_kv_events"


def test_generation_flags():
    # clear: no payload up to 0.5.5 (always forced), one `force` bool in 0.5.6
    assert [g.clear_takes_force for g in GENERATIONS] == [False, False, False, True, True]
    # lookups reject keys without num_kv_readers from 0.5.5 on (older ones ignore the field)
    assert [g.requires_num_kv_readers for g in GENERATIONS] == [False, False, True, True, True]
    # register_kv_cache: DeviceIPCWrapper ext data is pickle up to 0.5.5, msgpack in 0.5.6
    assert [g.ipc_wrapper_ext for g in GENERATIONS] == [False, False, False, True, True]
    # 0.5.7: token_bytes keys, defaulted trailing payloads sent, the envelope plane
    assert [g.token_bytes_keys for g in GENERATIONS] == [False] * 4 + [True]
    assert [g.inline_envelope for g in GENERATIONS] == [False] * 4 + [True]
    assert [g.events_capability for g in GENERATIONS] == [False] * 3 + [True, False]
    assert GEN_057.payloads(Op.PREPARE_STORE, ["k", 1]) == ("k", 1, ())
    assert GEN_057.payloads(Op.FREE_LOOKUP_LOCKS, ["k", 1]) == ("k", 1, ())
    assert GEN_056.payloads(Op.PREPARE_STORE, ["k", 1]) == ["k", 1]
    assert NEWEST is GEN_057
    covered = [v for g in GENERATIONS for v in g.versions]
    assert covered == sorted(OBSERVED)
