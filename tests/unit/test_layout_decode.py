"""Decoding /status cache_context_meta entries (docs/protocol.md §5.2, §6, §8.5, §8.6)."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout import (
    FORMATS,
    DecodedEntry,
    decode_kernel_group,
    decode_status_entry,
    find_model_entries,
    get_format,
    parse_concrete_shape,
)
from lmcache_kv_fast.layout.decode import format_layer_indices

# lmcache (the oracle) pulls in opentelemetry, which warns about its own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:opentelemetry")

# The real single-group entry observed on a live 0.5.6 server (docs/protocol.md §5.2).
REAL_ENTRY: dict[str, Any] = {
    "model_name": "cpu-test-model",
    "world_size": 1,
    "kv_cache_layout": {
        "num_layers": 4,
        "num_blocks": 64,
        "cache_size_per_token": 16384,
        "kernel_groups": [
            {
                "kernel_group_idx": 0,
                "engine_group_idx": 0,
                "object_group_idx": 0,
                "num_layers": 4,
                "layer_indices": [0, 1, 2, 3],
                "tokens_per_block": 16,
                "slots_per_block": 16,
                "dtype": "torch.bfloat16",
                "engine_kv_concrete_shape": "4 x [2, 64, 16, 8, 128]",
                "is_mla": False,
                "engine_kv_format": "NL_X_TWO_NB_BS_NH_HS",
                "engine_kv_shape": "NL x [2, NB, BS, NH, HS]",
                "attention_backend": "vLLM non-MLA flash attention",
            }
        ],
    },
}

ITEMSIZE = {"torch.bfloat16": 2, "torch.uint8": 1, "torch.float32": 4}


def make_kg(
    fmt: str,
    shape: str,
    *,
    layers: int = 3,
    first_layer: int = 0,
    tokens: int = 16,
    slots: int | None = None,
    dtype: str = "torch.bfloat16",
    idx: int = 0,
    engine_group: int = 0,
) -> dict[str, Any]:
    """A kernel group as 0.5.6 reports it."""
    spec = get_format(fmt)
    return {
        "kernel_group_idx": idx,
        "engine_group_idx": engine_group,
        "object_group_idx": 0,
        "num_layers": layers,
        "layer_indices": list(range(first_layer, first_layer + layers)),
        "tokens_per_block": tokens,
        "slots_per_block": tokens if slots is None else slots,
        "dtype": dtype,
        "engine_kv_concrete_shape": shape,
        "is_mla": spec.is_mla,
        "engine_kv_format": fmt,
        "engine_kv_shape": spec.symbolic_shape,
        "attention_backend": spec.backend,
    }


def make_entry(
    groups: list[dict[str, Any]], *, cps: int, world_size: int = 1, model: str = "m"
) -> dict[str, Any]:
    return {
        "model_name": model,
        "world_size": world_size,
        "kv_cache_layout": {
            "num_layers": sum(g["num_layers"] for g in groups),
            "num_blocks": 7,
            "cache_size_per_token": cps,
            "kernel_groups": groups,
        },
    }


def single(fmt: str, shape: str, *, kv: int, d: int, layers: int = 3, **kw: Any) -> dict:
    dtype = kw.get("dtype", "torch.bfloat16")
    return make_entry(
        [make_kg(fmt, shape, layers=layers, **kw)], cps=kv * layers * d * ITEMSIZE[dtype]
    )


# ---------------------------------------------------------------------- parse
@pytest.mark.parametrize(
    ("text", "levels", "inner"),
    [
        ("4 x [2, 64, 16, 8, 128]", (4,), (2, 64, 16, 8, 128)),
        ("3 x [10, 16, 576]", (3,), (10, 16, 576)),
        ("[7, 3, 2, 16, 4, 64]", (), (7, 3, 2, 16, 4, 64)),
        ("2 x 3 x [112, 4, 64]", (2, 3), (112, 4, 64)),
        ("3 x 2 x [7, 16, 4, 64]", (3, 2), (7, 16, 4, 64)),
        ("3 x NP x [7, 16, 1, 576]", (3, "NP"), (7, 16, 1, 576)),
        ("  4 x[2,64,16,8,128] ", (4,), (2, 64, 16, 8, 128)),
    ],
)
def test_parse_concrete_shape(text: str, levels: tuple, inner: tuple) -> None:
    assert parse_concrete_shape(text) == (levels, inner)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)", "prints no concrete shape"),
        ("4 x 2, 64", "expected"),
        ("4 x [2, 64", "expected"),
        ("4 x [2, 64] x", "expected"),
        ("4 x [2, a, 16]", "not all integers"),
        ("4 x []", "not all integers"),
        ("4 x [2, -1]", "negative"),
        ("4 [2, 64]", "joined with"),
        ("4 x ! x [2, 64]", "bad list level"),
        ("x [2, 64]", "bad list level"),
    ],
)
def test_parse_concrete_shape_refuses(text: str, match: str) -> None:
    with pytest.raises(KVCacheSDKError, match=match):
        parse_concrete_shape(text)


def test_parse_concrete_shape_refuses_non_str() -> None:
    with pytest.raises(KVCacheSDKError, match="expected a str, got 5"):
        parse_concrete_shape(5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- per format
# (format, concrete shape, dtype, cps-plane count kv, NH, head size, D, slots)
# docs/protocol.md §5.2 strings first, then one per remaining format with NB=7, BS=16, NH=4, HS=64, L=3
# (for 10/11 the string 0.5.6 really prints: packed head size in the HS position).
CASES = [
    ("NL_X_TWO_NB_BS_NH_HS", "3 x [2, 10, 16, 8, 128]", 2, 8, 128, 1024),
    ("NL_X_NB_BS_HS", "3 x [10, 16, 576]", 1, 1, 576, 576),
    ("NL_X_TWO_NB_NH_BS_HS", "3 x [2, 10, 4, 16, 64]", 2, 4, 64, 256),
    ("NL_X_NB_TWO_BS_NH_HS", "3 x [10, 2, 16, 4, 64]", 2, 4, 64, 256),
    ("NB_NL_TWO_BS_NH_HS", "[7, 3, 2, 16, 4, 64]", 2, 4, 64, 256),
    ("TWO_X_NL_X_NBBS_NH_HS", "2 x 3 x [112, 4, 64]", 2, 4, 64, 256),
    ("NL_X_NBBS_ONE_HS", "3 x [112, 1, 64]", 1, 1, 64, 64),
    ("NL_X_NB_TWO_NH_BS_HS", "3 x [7, 2, 4, 16, 64]", 2, 4, 64, 256),
    ("NB_NL_TWO_NH_BS_HS", "[7, 3, 2, 4, 16, 64]", 2, 4, 64, 256),
    ("TWO_X_NL_X_NB_BS_NH_HS", "2 x 3 x [7, 16, 4, 64]", 2, 4, 64, 256),
    ("NL_X_NB_NH_BS_TWO_HS", "3 x [7, 4, 16, 2, 128]", 1, 4, 128, 512),
    ("NL_X_NB_BS_NH_TWO_HS", "3 x [7, 16, 4, 2, 128]", 1, 4, 128, 512),
    ("NL_X_NB_NH_BS_CS", "3 x [7, 4, 16, 128]", 1, 4, 128, 512),
    ("NL_X_NB_BS_NH_CS", "3 x [7, 16, 4, 128]", 1, 4, 128, 512),
    ("NL_X_TWO_NB_NH_ONE_BS_HS", "3 x [2, 7, 4, 1, 16, 64]", 2, 4, 64, 256),
    ("NL_X_TWO_X_NB_BS_NH_HS", "3 x 2 x [7, 16, 4, 64]", 2, 4, 64, 256),
    ("NL_X_NP_X_NB_BS_ONE_HS", "3 x NP x [7, 16, 1, 576]", 1, 1, 576, 576),
    ("NL_X_NB_BS_NH_HS", "3 x [7, 16, 4, 64]", 1, 4, 64, 256),
]


@pytest.mark.parametrize(("fmt", "shape", "kv", "nh", "hs", "d"), CASES, ids=[c[0] for c in CASES])
def test_decode_each_format(fmt: str, shape: str, kv: int, nh: int, hs: int, d: int) -> None:
    entry = single(fmt, shape, kv=kv, d=d)
    dec = decode_status_entry(entry, 256)
    (g,) = dec.groups
    assert (g.format_name, g.planes, g.kv_size, g.num_heads, g.head_size, g.hidden_size) == (
        fmt, kv, kv, nh, hs, d,
    )
    assert (g.num_layers, g.block_size, g.slots_per_block, g.dtype, g.itemsize) == (
        3, 16, 16, "bfloat16", 2,
    )
    assert g.is_mla == get_format(fmt).is_mla
    assert g.layer_indices == (0, 1, 2) and g.concrete_shape == shape
    chunk = dec.require_single_group()
    assert chunk is dec.chunk and not dec.is_hybrid
    assert (chunk.planes, chunk.num_layers, chunk.hidden_size) == (kv, 3, d)
    assert chunk.use_mla == (kv == 1)
    assert chunk.num_physical_slots == 256
    assert chunk.shape == ((kv, 3, 256, d) if kv == 2 else (3, 256, d))
    assert chunk.nbytes == kv * 3 * 256 * d * 2
    # the same group decodes standalone, without cache_size_per_token
    assert decode_kernel_group(entry["kv_cache_layout"]["kernel_groups"][0],
                               cache_size_per_token=None) == g


def test_every_format_has_a_case() -> None:
    covered = {c[0] for c in CASES} | {"NL_X_NB_BSV_BSS"}  # 14: Unknown-only, below
    assert covered == {f.name for f in FORMATS}


def test_real_entry_from_doc() -> None:
    dec = decode_status_entry(REAL_ENTRY, 256)
    g = dec.groups[0]
    assert (g.num_heads, g.block_size, g.head_size, g.hidden_size, g.planes) == (
        8, 16, 128, 1024, 2,
    )
    assert (dec.model_name, dec.world_size, dec.num_layers, dec.num_blocks) == (
        "cpu-test-model", 1, 4, 64,
    )
    assert dec.cache_size_per_token == 16384 == 2 * 4 * 1024 * 2
    assert dec.chunk is not None and dec.chunk.shape == (2, 4, 256, 1024)
    assert dec.chunk.dtype == "bfloat16"


def test_mla_cps_from_doc() -> None:
    # docs/protocol.md §5.2: MLA "3 x [10, 16, 576]", cache_size_per_token 3456 = 1 * 3 * 576 * 2
    entry = make_entry([make_kg("NL_X_NB_BS_HS", "3 x [10, 16, 576]")], cps=3456)
    chunk = decode_status_entry(entry, 256).require_single_group()
    assert chunk.use_mla and chunk.shape == (3, 256, 576)


@pytest.mark.parametrize("fmt", ["NL_X_NB_NH_BS_CS", "NL_X_NB_BS_NH_CS"])
def test_unknown_fused_shape_takes_d_from_cps(fmt: str) -> None:
    shape = f"Unknown (EngineKVFormat.{fmt})"
    dec = decode_status_entry(single(fmt, shape, kv=1, d=512), 256)
    g = dec.groups[0]
    assert (g.hidden_size, g.num_heads, g.head_size, g.planes) == (512, None, None, 1)
    assert dec.require_single_group().shape == (3, 256, 512)


def test_unknown_dsa_indexer_takes_d_from_cps() -> None:
    fmt = "NL_X_NB_BSV_BSS"
    entry = single(fmt, f"Unknown (EngineKVFormat.{fmt})", kv=1, d=132, dtype="torch.uint8")
    g = decode_status_entry(entry, 256).groups[0]
    assert (g.hidden_size, g.num_heads, g.head_size, g.dtype, g.itemsize) == (
        132, 1, 132, "uint8", 1,
    )
    # a concrete DSA string carries BS but not the width: still from cps
    entry = single(fmt, "3 x [7, 16, 16]", kv=1, d=132, dtype="torch.uint8")
    assert decode_status_entry(entry, 256).groups[0].hidden_size == 132


@pytest.mark.parametrize("fmt", ["NL_X_NB_NH_BS_TWO_HS", "NL_X_NB_BS_NH_TWO_HS"])
def test_two_hs_per_half_string_resolved_by_cps(fmt: str) -> None:
    # the raw tensor string (doc's table) prints the per-half HS 64; cps picks 2 * 64
    shape = "3 x [7, 4, 16, 2, 64]" if "NH_BS" in fmt else "3 x [7, 16, 4, 2, 64]"
    g = decode_status_entry(single(fmt, shape, kv=1, d=512), 256).groups[0]
    assert (g.head_size, g.hidden_size) == (128, 512)
    # without cps the printed value is taken as the packed head size (0.5.6 /status)
    kg = single(fmt, shape, kv=1, d=512)["kv_cache_layout"]["kernel_groups"][0]
    assert decode_kernel_group(kg, cache_size_per_token=None).hidden_size == 256


def test_float32_and_world_size_carried() -> None:
    entry = single("NL_X_TWO_NB_BS_NH_HS", "3 x [2, 7, 16, 4, 64]", kv=2, d=256,
                   dtype="torch.float32")
    entry["world_size"] = 4
    dec = decode_status_entry(entry, 32)
    assert dec.world_size == 4 and dec.groups[0].itemsize == 4
    assert dec.chunk is not None and dec.chunk.num_physical_slots == 32


# ---------------------------------------------------------------------- error paths
def _err(entry: dict, match: str, chunk_size: int = 256) -> None:
    with pytest.raises(KVCacheSDKError, match=match):
        decode_status_entry(entry, chunk_size)


def _real() -> dict[str, Any]:
    return copy.deepcopy(REAL_ENTRY)


def _kg0(entry: dict) -> dict[str, Any]:
    return entry["kv_cache_layout"]["kernel_groups"][0]


@pytest.mark.parametrize(
    "key",
    ["engine_kv_format", "engine_kv_concrete_shape", "num_layers", "layer_indices",
     "tokens_per_block", "slots_per_block", "dtype"],
)
def test_missing_group_field_is_named(key: str) -> None:
    entry = _real()
    del _kg0(entry)[key]
    _err(entry, rf"kernel_groups\[0\]\.{key}: missing")


@pytest.mark.parametrize("key", ["model_name", "world_size", "kv_cache_layout"])
def test_missing_entry_field_is_named(key: str) -> None:
    entry = _real()
    del entry[key]
    _err(entry, rf"entry\.{key}: missing")


@pytest.mark.parametrize("key", ["num_layers", "cache_size_per_token", "kernel_groups"])
def test_missing_layout_field_is_named(key: str) -> None:
    entry = _real()
    del entry["kv_cache_layout"][key]
    _err(entry, rf"kv_cache_layout\.{key}: missing")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("num_layers", "4", r"num_layers: expected an int >= 1, got '4' \(str\)"),
        ("num_layers", True, r"num_layers: expected an int >= 1, got True \(bool\)"),
        ("num_layers", 0, r"num_layers: expected an int >= 1, got 0"),
        ("tokens_per_block", 16.0, r"tokens_per_block: expected an int"),
        ("slots_per_block", None, r"slots_per_block: expected an int"),
        ("layer_indices", [0, "1", 2, 3], r"layer_indices: expected a list of ints"),
        ("layer_indices", "0-3", r"layer_indices: expected a list of ints"),
        ("dtype", 5, r"dtype: expected a non-empty str, got 5 \(int\)"),
        ("dtype", "torch.bfloat17", r"dtype: expected a torch dtype name"),
        ("dtype", "torch.Tensor", r"dtype: expected a torch dtype name"),
        ("engine_kv_format", 1, r"engine_kv_format: expected a non-empty str"),
        ("engine_kv_format", "NL_X_NEW", r"unknown engine KV format 'NL_X_NEW'"),
        ("engine_kv_concrete_shape", [4, 2], r"engine_kv_concrete_shape: expected a str"),
        ("is_mla", "no", r"is_mla: expected a bool"),
        ("is_mla", True, r"is_mla is True but format NL_X_TWO_NB_BS_NH_HS is not MLA"),
        ("kernel_group_idx", -1, r"kernel_group_idx: expected an int >= 0"),
        ("engine_group_idx", "0", r"engine_group_idx: expected an int >= 0"),
    ],
)
def test_ill_typed_group_field(key: str, value: Any, match: str) -> None:
    entry = _real()
    _kg0(entry)[key] = value
    _err(entry, match)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda e: e.update(model_name=""), r"entry\.model_name: expected a non-empty str"),
        (lambda e: e.update(world_size=0), r"entry\.world_size: expected an int >= 1, got 0"),
        (lambda e: e.update(kv_cache_layout=[]), r"kv_cache_layout: expected an object"),
        (lambda e: e["kv_cache_layout"].update(kernel_groups=[]), r"expected a non-empty list"),
        (lambda e: e["kv_cache_layout"].update(kernel_groups={}), r"expected a non-empty list"),
        (lambda e: e["kv_cache_layout"].update(kernel_groups=[3]),
         r"kernel_groups\[0\]: expected an object, got 3"),
        (lambda e: e["kv_cache_layout"].update(num_blocks="64"), r"num_blocks: expected an int"),
        (lambda e: e["kv_cache_layout"].update(cache_size_per_token=0),
         r"cache_size_per_token: expected an int >= 1"),
    ],
)
def test_ill_typed_entry_field(mutate: Any, match: str) -> None:
    entry = _real()
    mutate(entry)
    _err(entry, match)


def test_entry_not_an_object() -> None:
    _err(["not", "a", "dict"], r"cache_context_meta entry: expected an object")  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk_size", [0, -256, "256", 256.0, True])
def test_bad_chunk_size(chunk_size: Any) -> None:
    _err(_real(), r"chunk_size: expected an int >= 1", chunk_size)


def test_chunk_size_not_multiple_of_block_size() -> None:
    _err(_real(), r"chunk_size 264 is not a multiple of the block size 16", 264)


def test_slots_per_block_differs_from_tokens_per_block() -> None:
    entry = _real()
    _kg0(entry).update(tokens_per_block=64, slots_per_block=16)
    entry["kv_cache_layout"]["cache_size_per_token"] = 16384 // 4  # compress ratio 4
    _err(entry, r"slots_per_block 16 != tokens_per_block 64")


def test_nl_in_string_differs_from_num_layers() -> None:
    entry = _real()
    _kg0(entry)["engine_kv_concrete_shape"] = "5 x [2, 64, 16, 8, 128]"
    _err(entry, r"has NL = 5 but .*num_layers is 4")


def test_cross_layer_nl_differs_from_num_layers() -> None:
    entry = single("NB_NL_TWO_BS_NH_HS", "[7, 5, 2, 16, 4, 64]", kv=2, d=256)
    _err(entry, r"has NL = 5 but .*num_layers is 3")


def test_layer_indices_length_differs_from_num_layers() -> None:
    entry = _real()
    _kg0(entry)["layer_indices"] = [0, 1, 2]
    _err(entry, r"layer_indices has 3 entries but .*num_layers is 4")


def test_block_size_in_string_differs_from_slots() -> None:
    entry = _real()
    _kg0(entry)["engine_kv_concrete_shape"] = "4 x [2, 64, 32, 8, 128]"
    _err(entry, r"has BS = 32 but .*slots_per_block is 16")


def test_pbs_not_multiple_of_slots() -> None:
    entry = single("TWO_X_NL_X_NBBS_NH_HS", "2 x 3 x [100, 4, 64]", kv=2, d=256)
    _err(entry, r"PBS = 100, not a multiple of slots_per_block 16")


@pytest.mark.parametrize(
    ("fmt", "shape", "match"),
    [
        ("NL_X_TWO_NB_BS_NH_HS", "3 x [2, 64, 16, 128]", "does not fit"),
        ("NL_X_TWO_NB_BS_NH_HS", "[3, 2, 64, 16, 8, 128]", "does not fit"),
        ("NL_X_TWO_NB_BS_NH_HS", "3 x [3, 64, 16, 8, 128]", r"dim 0 \(2\) is 3"),
        ("NL_X_TWO_NB_BS_NH_HS", "3 x [2, 0, 16, 8, 128]", r"dim 1 \(NB\) is 0"),
        ("TWO_X_NL_X_NB_BS_NH_HS", "3 x 3 x [7, 16, 4, 64]", r"list level 2 is 3"),
        ("NL_X_NP_X_NB_BS_ONE_HS", "3 x XP x [7, 16, 1, 576]", r"list level NP is 'XP'"),
        ("NL_X_NB_BS_HS", "NL x [7, 16, 576]", r"list level NL is 'NL'"),
    ],
)
def test_shape_not_fitting_format(fmt: str, shape: str, match: str) -> None:
    _err(single(fmt, shape, kv=2, d=256), match)


def test_unknown_string_for_a_format_with_a_concrete_shape() -> None:
    entry = _real()
    _kg0(entry)["engine_kv_concrete_shape"] = "Unknown (EngineKVFormat.NL_X_TWO_NB_BS_NH_HS)"
    _err(entry, r"LMCache 0.5.6 prints a concrete shape for NL_X_TWO_NB_BS_NH_HS")


def test_cache_size_per_token_mismatch() -> None:
    entry = _real()
    entry["kv_cache_layout"]["cache_size_per_token"] = 8192
    _err(entry, r"= 16384 bytes per token, but cache_size_per_token is 8192")


def test_unknown_shape_needs_cps() -> None:
    kg = make_kg("NL_X_NB_NH_BS_CS", "Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)")
    with pytest.raises(KVCacheSDKError, match="does not carry the hidden size"):
        decode_kernel_group(kg, cache_size_per_token=None)


def test_unknown_shape_cps_not_divisible() -> None:
    fmt = "NL_X_NB_NH_BS_CS"
    entry = make_entry([make_kg(fmt, f"Unknown (EngineKVFormat.{fmt})")], cps=1001)
    _err(entry, r"cannot derive D .* from cache_size_per_token 1001")


def test_decode_kernel_group_checks_cps_type() -> None:
    with pytest.raises(KVCacheSDKError, match="cache_size_per_token: expected an int"):
        decode_kernel_group(_kg0(_real()), cache_size_per_token="16384")  # type: ignore[arg-type]


def test_decode_kernel_group_not_an_object() -> None:
    with pytest.raises(KVCacheSDKError, match=r"kernel_groups\[0\]: expected an object"):
        decode_kernel_group([1, 2], cache_size_per_token=None)  # type: ignore[arg-type]


def test_symbolic_shape_disagreement_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    entry = _real()
    _kg0(entry)["engine_kv_shape"] = "NL x [2, NB, NH, BS, HS]"
    with caplog.at_level(logging.WARNING, logger="lmcache_kv_fast.layout.decode_group"):
        dec = decode_status_entry(entry, 256)
    assert dec.groups[0].hidden_size == 1024
    assert "engine_kv_shape" in caplog.text


def test_optional_fields_default() -> None:
    entry = _real()
    for key in ("kernel_group_idx", "engine_group_idx", "object_group_idx", "is_mla",
                "engine_kv_shape", "attention_backend"):
        del _kg0(entry)[key]
    del entry["kv_cache_layout"]["num_blocks"]
    dec = decode_status_entry(entry, 256)
    g = dec.groups[0]
    assert (g.kernel_group_idx, g.engine_group_idx, g.object_group_idx) == (0, 0, 0)
    assert dec.num_blocks is None and g.hidden_size == 1024


# ---------------------------------------------------------------------- hybrid (§8.6)
def _hybrid() -> dict[str, Any]:
    full = make_kg("NL_X_TWO_NB_BS_NH_HS", "2 x [2, 7, 16, 4, 64]", layers=2, idx=0)
    full["layer_indices"] = [0, 2]
    swa = make_kg("NL_X_TWO_NB_BS_NH_HS", "2 x [2, 7, 64, 4, 64]", layers=2, tokens=64,
                  idx=1, engine_group=1)
    swa["layer_indices"] = [1, 3]
    return make_entry([full, swa], cps=2 * 2 * 256 * 2 * 2)


def test_hybrid_decodes_per_group_without_raising() -> None:
    dec = decode_status_entry(_hybrid(), 256)
    assert isinstance(dec, DecodedEntry) and dec.is_hybrid and dec.chunk is None
    a, b = dec.groups
    assert (a.layer_indices, a.block_size, a.engine_group_idx, a.hidden_size) == (
        (0, 2), 16, 0, 256,
    )
    assert (b.layer_indices, b.block_size, b.engine_group_idx, b.hidden_size) == (
        (1, 3), 64, 1, 256,
    )


def test_hybrid_refused_by_require_single_group() -> None:
    dec = decode_status_entry(_hybrid(), 256)
    with pytest.raises(KVCacheSDKError) as info:
        dec.require_single_group()
    msg = str(info.value)
    assert "2 kernel groups" in msg and "§8.6" in msg and "engine-driven" in msg
    assert "layers 0, 2 (2)" in msg and "layers 1, 3 (2)" in msg
    assert msg.count("format NL_X_TWO_NB_BS_NH_HS") == 2
    assert "block_size 16" in msg and "block_size 64" in msg


def test_hybrid_allows_compressed_groups_and_odd_chunk_sizes() -> None:
    entry = _hybrid()
    entry["kv_cache_layout"]["kernel_groups"][1].update(tokens_per_block=256)
    entry["kv_cache_layout"]["cache_size_per_token"] = 2 * 2 * 256 * 2 + 2 * 2 * 256 * 2 // 4
    dec = decode_status_entry(entry, 48)
    assert dec.groups[1].compress_ratio == 4 and dec.chunk is None
    assert "slots_per_block 64" in dec.groups[1].describe()


def test_hybrid_cps_mismatch_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    entry = _hybrid()
    entry["kv_cache_layout"]["cache_size_per_token"] = 1
    with caplog.at_level(logging.WARNING, logger="lmcache_kv_fast.layout.decode"):
        dec = decode_status_entry(entry, 256)
    assert dec.is_hybrid and "cache_size_per_token is 1" in caplog.text


def test_hybrid_single_unknown_group_gets_remainder() -> None:
    entry = _hybrid()
    fmt = "NL_X_NB_NH_BS_CS"
    unknown = make_kg(fmt, f"Unknown (EngineKVFormat.{fmt})", layers=1, first_layer=4, idx=2)
    entry["kv_cache_layout"]["kernel_groups"].append(unknown)
    entry["kv_cache_layout"]["cache_size_per_token"] += 1 * 1 * 512 * 2
    dec = decode_status_entry(entry, 256)
    assert dec.groups[2].hidden_size == 512 and dec.groups[2].num_heads is None


def test_hybrid_two_unknown_groups_leave_d_unknown() -> None:
    fmt = "NL_X_NB_NH_BS_CS"
    a = make_kg(fmt, f"Unknown (EngineKVFormat.{fmt})", layers=1, idx=0)
    b = make_kg(fmt, f"Unknown (EngineKVFormat.{fmt})", layers=1, first_layer=1, idx=1)
    dec = decode_status_entry(make_entry([a, b], cps=2048), 256)
    assert [g.hidden_size for g in dec.groups] == [None, None]
    with pytest.raises(KVCacheSDKError, match=r"D \?, bfloat16"):
        dec.require_single_group()


def test_hybrid_unusable_remainder_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    entry = _hybrid()
    fmt = "NL_X_NB_NH_BS_CS"
    entry["kv_cache_layout"]["kernel_groups"].append(
        make_kg(fmt, f"Unknown (EngineKVFormat.{fmt})", layers=1, first_layer=4, idx=2)
    )
    entry["kv_cache_layout"]["cache_size_per_token"] += 3  # not a whole D
    with caplog.at_level(logging.WARNING, logger="lmcache_kv_fast.layout.decode"):
        dec = decode_status_entry(entry, 256)
    assert dec.groups[2].hidden_size is None and "cannot derive D" in caplog.text


def test_hybrid_group_errors_still_raise() -> None:
    entry = _hybrid()
    entry["kv_cache_layout"]["kernel_groups"][1]["engine_kv_concrete_shape"] = (
        "9 x [2, 7, 64, 4, 64]"
    )
    _err(entry, r"kernel_groups\[1\]\.engine_kv_concrete_shape .* has NL = 9")


# ---------------------------------------------------------------------- find entries
def test_find_model_entries_one_per_rank() -> None:
    rank0, rank1, other = _real(), _real(), _real()
    rank1["world_size"] = rank0["world_size"] = 2
    other["model_name"] = "other"
    status = {"is_healthy": True,
              "cache_context_meta": {"11": rank0, "12": other, "13": rank1}}
    found = find_model_entries(status, "cpu-test-model")
    assert [iid for iid, _ in found] == ["11", "13"]
    assert found[0][1] is rank0 and found[1][1] is rank1
    assert find_model_entries(status, "absent") == []


def test_find_model_entries_without_meta() -> None:
    assert find_model_entries({"is_healthy": True}, "m") == []
    assert find_model_entries({"cache_context_meta": None}, "m") == []
    assert find_model_entries({"cache_context_meta": {}}, "m") == []


def test_find_model_entries_refuses_bad_shapes(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(KVCacheSDKError, match="/status: expected an object"):
        find_model_entries([], "m")  # type: ignore[arg-type]
    with pytest.raises(KVCacheSDKError, match="cache_context_meta: expected an object"):
        find_model_entries({"cache_context_meta": [1]}, "m")
    with caplog.at_level(logging.WARNING, logger="lmcache_kv_fast.layout.decode"):
        found = find_model_entries({"cache_context_meta": {"1": "junk", "2": REAL_ENTRY}},
                                   "cpu-test-model")
    assert found == [("2", REAL_ENTRY)] and "ignored" in caplog.text


@pytest.mark.parametrize(
    ("indices", "text"),
    [([0, 1, 2, 3], "0-3"), ([3, 0, 1, 8, 10, 11], "0-1, 3, 8, 10-11"), ([], "none"),
     ([5], "5"), ([2, 2, 3], "2-3")],
)
def test_format_layer_indices(indices: list[int], text: str) -> None:
    assert format_layer_indices(indices) == text


# ---------------------------------------------------------------------- oracle: lmcache
def _oracle_kv_caches(torch: Any, value: int) -> tuple[list | Any, Any]:
    """Meta tensors of every format with NB=7, BS=16, NH=4, HS=64, NL=3 (doc's probe)."""
    nb, bs, nh, hs, nl = 7, 16, 4, 64, 3

    def m(*shape: int, dtype: Any = torch.bfloat16) -> Any:
        return torch.empty(*shape, device="meta", dtype=dtype)

    per_layer = {
        1: (2, nb, bs, nh, hs), 2: (nb, 2, bs, nh, hs), 3: (nb, bs, 576), 5: (nb * bs, 1, hs),
        6: (2, nb, nh, bs, hs), 7: (nb, 2, nh, bs, hs), 10: (nb, nh, bs, 2, hs),
        11: (nb, bs, nh, 2, hs), 12: (nb, nh, bs, 2 * hs), 13: (nb, bs, nh, 2 * hs),
        15: (2, nb, nh, 1, bs, hs), 18: (nb, bs, nh, hs),
    }
    if value in per_layer:
        return [m(*per_layer[value]) for _ in range(nl)], torch.bfloat16
    if value == 0:
        return m(nb, nl, 2, bs, nh, hs), torch.bfloat16
    if value == 8:
        return m(nb, nl, 2, nh, bs, hs), torch.bfloat16
    if value == 4:
        return [[m(nb * bs, nh, hs) for _ in range(nl)] for _ in range(2)], torch.bfloat16
    if value == 9:
        return [[m(nb, bs, nh, hs) for _ in range(nl)] for _ in range(2)], torch.bfloat16
    if value == 14:
        return [m(nb, bs, 132, dtype=torch.uint8) for _ in range(nl)], torch.uint8
    if value == 16:
        return [(m(nb, bs, nh, hs), m(nb, bs, nh, hs)) for _ in range(nl)], torch.bfloat16
    assert value == 17
    return [(m(nb, bs, 1, 512), m(nb, bs, 1, 64)) for _ in range(nl)], torch.bfloat16


@pytest.fixture(scope="module")
def oracle() -> Any:
    pytest.importorskip("lmcache.lmcache_native")
    import lmcache.lmcache_native as native
    import torch
    from lmcache.v1.gpu_connector import utils

    return torch, utils, native


@pytest.mark.parametrize("spec", FORMATS, ids=lambda f: f.name)
def test_oracle_status_strings_decode_like_lmcache(oracle: Any, spec: Any) -> None:
    """Build the kernel group 0.5.6 reports with lmcache's own helpers; decode it."""
    torch, utils, native = oracle
    fmt = native.EngineKVFormat(spec.value)
    kv_caches, dtype = _oracle_kv_caches(torch, spec.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # formats 10/11 are deprecated upstream
        desc = utils.make_page_buffer_shape_desc(kv_caches, fmt, 0, 3, 7, 16)
        concrete = utils.get_concrete_engine_kv_shape_from_shape_desc(desc, fmt)
        kv_size = utils.get_kv_size(kv_caches, fmt)
        num_heads = utils.get_num_heads(kv_caches, fmt)
        block_size = None if spec.pbs_index is not None else utils.get_block_size(kv_caches, fmt)
    server_d = desc.nh * desc.hs  # KernelGroupInfo.hidden_dim_size
    kg = {
        "kernel_group_idx": 0, "engine_group_idx": 0, "object_group_idx": 0,
        "num_layers": 3, "layer_indices": [0, 1, 2], "tokens_per_block": 16,
        "slots_per_block": desc.bs, "dtype": str(dtype),
        "engine_kv_concrete_shape": concrete, "is_mla": bool(native.is_mla(fmt)),
        "engine_kv_format": fmt.name,
        "engine_kv_shape": utils.get_engine_kv_shape_description(fmt),
    }
    cps = kv_size * 3 * server_d * dtype.itemsize
    assert concrete.startswith("Unknown (") == (not spec.status_shape_known)
    g = decode_kernel_group(kg, cache_size_per_token=cps)
    assert g.planes == kv_size
    assert g.hidden_size == server_d
    if block_size is not None:
        assert g.block_size == block_size == 16
    if g.num_heads is not None:
        assert g.num_heads == (1 if spec.is_mla else num_heads)
    if g.head_size is not None:
        assert g.head_size == desc.hs
    chunk = decode_status_entry(make_entry([kg], cps=cps), 256).require_single_group()
    assert chunk.shape[-1] == server_d
