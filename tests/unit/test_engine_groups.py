"""Engine-group helpers (docs/protocol.md §4.6)."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout import engine_groups as eg
from lmcache_kv_fast.layout.engine_groups import (
    EXCLUDED_ENGINE_GROUP,
    EngineGroupInfo,
    engine_group_layer_indices,
    expand_engine_block_ids,
    get_engine_group_indices,
    groups_from_status_entry,
    num_engine_group_infos,
    num_engine_groups,
    slice_block_ids_per_group,
)
from lmcache_kv_fast.protocol import types as wire

# lmcache (the oracle) pulls in opentelemetry, which warns about its own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:opentelemetry")


def G(gid: int, layers: tuple[int, ...] = (), tpb: int = 0, sw: int = -1) -> EngineGroupInfo:
    return EngineGroupInfo(
        engine_group_id=gid, layer_indices=layers, tokens_per_block=tpb, sw_size_tokens=sw
    )


# Two LMCache groups split one engine group (differing hidden dims), plus a SWA group.
HYBRID = [G(0, (0, 2), 16), G(1, (1, 3), 64, 1024), G(0, (4,), 16)]


# ---------------------------------------------------------------------- the struct
def test_struct_is_the_wire_type() -> None:
    assert EngineGroupInfo is wire.EngineGroupInfo
    info = EngineGroupInfo(engine_group_id=0)
    assert (info.layer_indices, info.tokens_per_block, info.sw_size_tokens) == ((), 0, -1)
    assert (info.extra_object_group_tag, info.recurrent_state) == (0, False)
    with pytest.raises(AttributeError):
        info.engine_group_id = 1  # type: ignore[misc]


def test_struct_msgpack_sends_all_six_keys_and_round_trips() -> None:
    info = G(1, (1, 3), 64, 1024)
    raw = msgspec.msgpack.encode(info)
    assert msgspec.msgpack.decode(raw) == {
        "engine_group_id": 1, "layer_indices": [1, 3], "tokens_per_block": 64,
        "sw_size_tokens": 1024, "extra_object_group_tag": 0, "recurrent_state": False,
    }
    assert msgspec.msgpack.decode(raw, type=EngineGroupInfo) == info


# ---------------------------------------------------------------------- counts
def test_num_engine_groups() -> None:
    assert num_engine_groups([]) == 1
    assert num_engine_groups([G(0)]) == 1
    assert num_engine_groups(HYBRID) == 2
    assert num_engine_groups([G(2)]) == 3  # ids are assumed dense: max + 1


def test_num_engine_group_infos() -> None:
    assert num_engine_group_infos([]) == 1
    assert num_engine_group_infos([G(0)]) == 1
    assert num_engine_group_infos(HYBRID) == 3


def test_engine_group_layer_indices() -> None:
    assert engine_group_layer_indices([]) == []
    assert engine_group_layer_indices(HYBRID) == [[0, 2, 4], [1, 3]]
    assert engine_group_layer_indices([G(1, (5, 4))]) == [[], [4, 5]]


# ---------------------------------------------------------------------- expand
def test_expand_per_engine_group_lists() -> None:
    out = expand_engine_block_ids(HYBRID, [[10, 11], [20]])
    assert out == [[10, 11], [20], [10, 11]]
    out[0].append(99)
    assert out[2] == [10, 11]  # every LMCache group gets its own copy


def test_expand_flat_back_compat() -> None:
    assert expand_engine_block_ids([], [1, 2, 3]) == [[1, 2, 3]]
    assert expand_engine_block_ids([G(0, (0,)), G(0, (1,))], (4, 5)) == [[4, 5], [4, 5]]
    assert expand_engine_block_ids([], [[7, 8]]) == [[7, 8]]


def test_expand_empty_means_no_blocks() -> None:
    assert expand_engine_block_ids([], []) == [[]]
    assert expand_engine_block_ids(HYBRID, []) == [[], [], []]


def test_expand_missing_engine_group() -> None:
    with pytest.raises(ValueError, match=r"LMCache group 1 reads engine group 1, but block "
                                         r"ids were given for 1 engine group"):
        expand_engine_block_ids(HYBRID, [[1, 2]])
    with pytest.raises(ValueError, match="reads engine group 1"):
        expand_engine_block_ids(HYBRID, [1, 2])  # flat form is engine group 0 only


# ---------------------------------------------------------------------- slice
def test_slice_example_from_docstring() -> None:
    ids = {0: list(range(100, 108)), 1: [200, 201]}
    assert slice_block_ids_per_group(ids, [64, 256], 0, 256) == [[100, 101, 102, 103], [200]]
    assert slice_block_ids_per_group(ids, [64, 256], 256, 512) == [[104, 105, 106, 107], [201]]


def test_slice_missing_group_and_empty_range() -> None:
    assert slice_block_ids_per_group({}, [16, 16], 0, 32) == [[], []]
    assert slice_block_ids_per_group({0: [1, 2]}, [16], 32, 32) == [[]]
    assert slice_block_ids_per_group({0: [1, 2]}, [], 0, 32) == []


@pytest.mark.parametrize(("start", "end"), [(8, 32), (0, 40)])
def test_slice_misaligned(start: int, end: int) -> None:
    with pytest.raises(ValueError, match=rf"token range \[{start}, {end}\) does not align to "
                                         r"group 1 tokens_per_block 16"):
        slice_block_ids_per_group({0: [1] * 8, 1: [2] * 8}, [8, 16], start, end)


@pytest.mark.parametrize("tpb", [0, -16])
def test_slice_non_positive_tokens_per_block(tpb: int) -> None:
    with pytest.raises(ValueError, match=rf"group 0 tokens_per_block must be positive, got {tpb}"):
        slice_block_ids_per_group({0: [1]}, [tpb], 0, 16)


@pytest.mark.parametrize(("start", "end"), [(32, 16), (-16, 16)])
def test_slice_bad_range(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="is not a valid range"):
        slice_block_ids_per_group({0: [1, 2, 3]}, [16], start, end)


# ---------------------------------------------------------------------- per-layer map
def test_get_engine_group_indices() -> None:
    assert get_engine_group_indices([], 4) is None
    assert get_engine_group_indices(HYBRID, 0) is None
    assert get_engine_group_indices(HYBRID, 6) == [0, 1, 0, 1, 0, EXCLUDED_ENGINE_GROUP]
    assert EXCLUDED_ENGINE_GROUP == -1


@pytest.mark.parametrize("layer", [-1, 5])
def test_get_engine_group_indices_out_of_range(layer: int) -> None:
    with pytest.raises(ValueError, match=rf"Layer index {layer} is outside registered layer "
                                         r"range \[0, 5\)"):
        get_engine_group_indices([G(0, (0, layer))], 5)


def test_get_engine_group_indices_negative_count() -> None:
    with pytest.raises(ValueError, match="num_registered_layers must be >= 0, got -1"):
        get_engine_group_indices([G(0)], -1)


# ---------------------------------------------------------------------- from /status
STATUS_ENTRY: dict[str, Any] = {
    "model_name": "hybrid",
    "world_size": 1,
    "kv_cache_layout": {
        "num_layers": 4,
        "cache_size_per_token": 1,
        "kernel_groups": [
            {"kernel_group_idx": 0, "engine_group_idx": 0, "layer_indices": [0, 2],
             "tokens_per_block": 16},
            {"kernel_group_idx": 1, "engine_group_idx": 1, "layer_indices": [1, 3],
             "tokens_per_block": 64},
        ],
    },
}


def test_groups_from_status_entry() -> None:
    assert groups_from_status_entry(STATUS_ENTRY) == [G(0, (0, 2), 16), G(1, (1, 3), 64)]


def test_groups_from_status_entry_defaults() -> None:
    entry = copy.deepcopy(STATUS_ENTRY)
    del entry["kv_cache_layout"]["kernel_groups"][0]["engine_group_idx"]
    del entry["kv_cache_layout"]["kernel_groups"][0]["tokens_per_block"]
    assert groups_from_status_entry(entry)[0] == G(0, (0, 2), 0)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("engine_group_idx", "1", r"kernel_groups\[1\]\.engine_group_idx: expected an int >= 0"),
        ("engine_group_idx", -1, r"engine_group_idx: expected an int >= 0, got -1"),
        ("layer_indices", None, r"kernel_groups\[1\]\.layer_indices: expected a list of ints"),
        ("layer_indices", [1, True], r"layer_indices: expected a list of ints"),
        ("tokens_per_block", 1.5, r"tokens_per_block: expected an int >= 0"),
    ],
)
def test_groups_from_status_entry_refuses(key: str, value: Any, match: str) -> None:
    entry = copy.deepcopy(STATUS_ENTRY)
    entry["kv_cache_layout"]["kernel_groups"][1][key] = value
    with pytest.raises(KVCacheSDKError, match=match):
        groups_from_status_entry(entry)


def test_groups_from_status_entry_missing_layout() -> None:
    with pytest.raises(KVCacheSDKError, match=r"entry\.kv_cache_layout: missing"):
        groups_from_status_entry({"model_name": "m"})
    with pytest.raises(KVCacheSDKError, match="kernel_groups: expected a non-empty list"):
        groups_from_status_entry({"kv_cache_layout": {"kernel_groups": []}})


def test_module_exports() -> None:
    assert set(eg.__all__) <= set(dir(eg))


# ---------------------------------------------------------------------- oracle: lmcache
@pytest.fixture(scope="module")
def upstream() -> Any:
    return pytest.importorskip("lmcache.v1.multiprocess.group_view")


def _theirs(upstream: Any, groups: list[EngineGroupInfo]) -> list[Any]:
    return [
        upstream.EngineGroupInfo(g.engine_group_id, g.layer_indices, g.tokens_per_block,
                                 g.sw_size_tokens)
        for g in groups
    ]


@pytest.mark.parametrize("groups", [[], [G(0, (0, 1, 2))], HYBRID, [G(1, (3,)), G(0, (1, 0))]])
def test_oracle_same_results(upstream: Any, groups: list[EngineGroupInfo]) -> None:
    theirs = _theirs(upstream, groups)
    assert num_engine_groups(groups) == upstream.num_engine_groups(theirs)
    assert num_engine_group_infos(groups) == upstream.num_engine_group_infos(theirs)
    assert engine_group_layer_indices(groups) == upstream.engine_group_layer_indices(theirs)
    block_ids = [[1, 2], [3]][: num_engine_groups(groups)]
    assert expand_engine_block_ids(groups, block_ids) == upstream.expand_engine_block_ids(
        theirs, block_ids
    )
    assert get_engine_group_indices(groups, 6) == upstream.get_engine_group_indices(theirs, 6)
    ids = {0: list(range(10)), 1: list(range(20, 30))}
    assert slice_block_ids_per_group(ids, [16, 64], 64, 128) == (
        upstream.slice_block_ids_per_group(ids, [16, 64], 64, 128)
    )


def test_oracle_wire_compatible(upstream: Any) -> None:
    theirs = upstream.EngineGroupInfo(1, (1, 3), 64, 1024)
    raw = msgspec.msgpack.encode(theirs)
    assert msgspec.msgpack.decode(raw, type=EngineGroupInfo) == G(1, (1, 3), 64, 1024)
    assert msgspec.msgpack.encode(G(1, (1, 3), 64, 1024)) == raw
