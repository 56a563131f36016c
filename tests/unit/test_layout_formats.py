"""The EngineKVFormat table (docs/protocol.md §6.1)."""

from __future__ import annotations

import enum

import pytest

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.formats import FORMATS, EngineKVFormat, FormatSpec, get_format

# lmcache (the oracle) pulls in opentelemetry, which warns about its own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:opentelemetry")

# value -> symbolic shape as /status prints engine_kv_shape (docs/protocol.md §6.1 "per-layer tensor").
SYMBOLIC = {
    0: "[NB, NL, 2, BS, NH, HS]",
    1: "NL x [2, NB, BS, NH, HS]",
    2: "NL x [NB, 2, BS, NH, HS]",
    3: "NL x [NB, BS, HS]",
    4: "2 x NL x [PBS, NH, HS]",
    5: "NL x [PBS, 1, HS]",
    6: "NL x [2, NB, NH, BS, HS]",
    7: "NL x [NB, 2, NH, BS, HS]",
    8: "[NB, NL, 2, NH, BS, HS]",
    9: "2 x NL x [NB, BS, NH, HS]",
    10: "NL x [NB, NH, BS, 2, HS]",
    11: "NL x [NB, BS, NH, 2, HS]",
    12: "NL x [NB, NH, BS, CS]",
    13: "NL x [NB, BS, NH, CS]",
    14: "NL x [NB, BSxVALS, BSxSCALES]",
    15: "NL x [2, NB, NH, 1, BS, HS]",
    16: "NL x 2 x [NB, BS, NH, HS]",
    17: "NL x NP x [NB, BS, 1, HS]",
    18: "NL x [NB, BS, NH, HS]",
}
# value -> (NH index, BS index, head-size index) in the innermost bracket (docs/protocol.md §6.1).
INDICES = {
    0: (4, 3, 5), 1: (3, 2, 4), 2: (3, 2, 4), 3: (None, 1, 2), 4: (1, None, 2),
    5: (None, None, 2), 6: (2, 3, 4), 7: (2, 3, 4), 8: (3, 4, 5), 9: (2, 1, 3),
    10: (1, 2, 4), 11: (2, 1, 4), 12: (1, 2, 3), 13: (2, 1, 3), 14: (None, 1, None),
    15: (2, 4, 5), 16: (2, 1, 3), 17: (None, 1, 3), 18: (2, 1, 3),
}
SINGLE_PLANE = {3, 5, 10, 11, 12, 13, 14, 17, 18}
MLA = {3, 5, 14, 17}
FUSED = {10, 11, 12, 13}
UNKNOWN_STATUS_SHAPE = {12, 13, 14}
KV_TUPLE = {16, 17}
CROSS_LAYER = {0, 8}


def test_table_covers_values_0_to_18_in_order() -> None:
    assert [f.value for f in FORMATS] == list(range(19))
    assert len({f.name for f in FORMATS}) == 19


def test_enum_mirrors_table() -> None:
    assert issubclass(EngineKVFormat, enum.IntEnum)
    assert [(m.name, m.value) for m in EngineKVFormat] == [(f.name, f.value) for f in FORMATS]
    assert EngineKVFormat.NL_X_TWO_NB_BS_NH_HS == 1


@pytest.mark.parametrize("spec", FORMATS, ids=lambda f: f.name)
def test_symbolic_shape_and_indices(spec: FormatSpec) -> None:
    assert spec.symbolic_shape == SYMBOLIC[spec.value]
    assert (spec.nh_index, spec.bs_index, spec.head_index) == INDICES[spec.value]


@pytest.mark.parametrize("spec", FORMATS, ids=lambda f: f.name)
def test_flag_columns(spec: FormatSpec) -> None:
    assert spec.kv_size == (1 if spec.value in SINGLE_PLANE else 2)
    assert spec.is_mla == (spec.value in MLA)
    assert spec.fused_kv == (spec.value in FUSED)
    assert spec.status_shape_known == (spec.value not in UNKNOWN_STATUS_SHAPE)
    assert spec.kv_tuple == (spec.value in KV_TUPLE)
    assert spec.single_kv == (spec.value == 18)
    assert spec.is_cross_layer == (spec.value in CROSS_LAYER)
    assert spec.deprecated == (spec.value in {10, 11})
    assert spec.backend


def test_list_levels_and_nl_position() -> None:
    assert get_format(1).list_levels == ("NL",)
    assert get_format(4).list_levels == ("2", "NL") and get_format(4).nl_level == 1
    assert get_format(16).list_levels == ("NL", "2") and get_format(16).nl_level == 0
    assert get_format(17).list_levels == ("NL", "NP")
    assert get_format(0).list_levels == () and get_format(0).nl_index == 1
    assert get_format(8).nl_index == 1 and get_format(8).nl_level is None
    assert get_format(4).pbs_index == 0 and get_format(5).pbs_index == 0
    assert get_format(1).pbs_index is None


def test_head_size_multipliers_only_for_two_hs_fused() -> None:
    assert {f.value for f in FORMATS if f.head_size_multipliers != (1,)} == {10, 11}
    assert get_format(10).head_size_multipliers == (1, 2)


def test_concrete_shape_rendering() -> None:
    sizes = {"NL": 4, "NB": 64, "BS": 16, "NH": 8, "HS": 128}
    assert get_format(1).concrete_shape(sizes) == "4 x [2, 64, 16, 8, 128]"
    assert get_format(17).concrete_shape({"NL": 3, "NB": 7, "BS": 16, "HS": 576}) == (
        "3 x NP x [7, 16, 1, 576]"
    )
    assert get_format(4).concrete_shape({"NL": 3, "PBS": 112, "NH": 4, "HS": 64}) == (
        "2 x 3 x [112, 4, 64]"
    )
    with pytest.raises(KeyError):
        get_format(12).concrete_shape(sizes)  # no CS size


@pytest.mark.parametrize(
    "key",
    ["NL_X_NB_BS_HS", "EngineKVFormat.NL_X_NB_BS_HS", 3, EngineKVFormat.NL_X_NB_BS_HS],
)
def test_get_format_accepts_names_values_and_members(key: object) -> None:
    assert get_format(key).value == 3  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["NL_X_FOO", "", 19, -1, True, 2.0, None])
def test_get_format_refuses_unknown(key: object) -> None:
    with pytest.raises(KVCacheSDKError, match="unknown engine KV format"):
        get_format(key)  # type: ignore[arg-type]


def test_spec_is_frozen() -> None:
    with pytest.raises(AttributeError):
        FORMATS[1].kv_size = 1  # type: ignore[misc]


# ---------------------------------------------------------------------- oracle: lmcache
@pytest.fixture(scope="module")
def lmc() -> object:
    pytest.importorskip("lmcache.lmcache_native")
    import lmcache.lmcache_native as native
    from lmcache.v1.gpu_connector.kv_format import describe_shape, get_spec_class

    return native, describe_shape, get_spec_class


def test_oracle_enum_matches(lmc: object) -> None:
    native = lmc[0]  # type: ignore[index]
    theirs = [(name, int(m)) for name, m in native.EngineKVFormat.__members__.items()]
    assert theirs == [(m.name, m.value) for m in EngineKVFormat]
    assert get_format(native.EngineKVFormat.NL_X_NB_BS_HS).value == 3


@pytest.mark.parametrize("spec", FORMATS, ids=lambda f: f.name)
def test_oracle_static_facts_match(lmc: object, spec: FormatSpec) -> None:
    native, describe_shape, get_spec_class = lmc  # type: ignore[misc]
    fmt = native.EngineKVFormat(spec.value)
    cls = get_spec_class(fmt)
    assert describe_shape(fmt) == spec.symbolic_shape
    assert bool(native.is_mla(fmt)) == spec.is_mla == cls.is_mla
    assert cls.is_cross_layer == spec.is_cross_layer
    assert cls.is_kv_second_tuple == spec.kv_tuple
    assert cls.is_single_kv == spec.single_kv
    assert cls.is_fused_packed == spec.fused_kv
