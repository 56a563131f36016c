"""KVLayout: the whole-model geometry value type."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from lmcache_kv_fast.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
)
from lmcache_kv_fast.layout import (
    SUPPORTED_DTYPES,
    KVLayout,
    decode_status_entry,
    normalize_dtype,
)


def entry(
    fmt: str = "NL_X_TWO_NB_BS_NH_HS",
    shape: str = "4 x [2, 64, 16, 8, 128]",
    *,
    kv: int = 2,
    d: int = 1024,
    layers: int = 4,
    world_size: int = 1,
    is_mla: bool = False,
    groups: int = 1,
) -> dict[str, Any]:
    kg = {
        "num_layers": layers, "layer_indices": list(range(layers)), "tokens_per_block": 16,
        "slots_per_block": 16, "dtype": "torch.bfloat16", "engine_kv_concrete_shape": shape,
        "is_mla": is_mla, "engine_kv_format": fmt,
    }
    kgs = [dict(kg, kernel_group_idx=i, engine_group_idx=i) for i in range(groups)]
    return {
        "model_name": "m", "world_size": world_size,
        "kv_cache_layout": {"num_layers": layers * groups,
                            "cache_size_per_token": groups * kv * layers * d * 2,
                            "kernel_groups": kgs},
    }


# ---------------------------------------------------------------------- construction
def test_basic_properties() -> None:
    lay = KVLayout(32, 8, 128, torch.bfloat16)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.mla) == (
        32, 8, 128, 16, False,
    )
    assert lay.planes == 2 and lay.hidden_size == 1024
    assert lay.itemsize == 2 and lay.dtype_str == "bfloat16" and lay.dtype is torch.bfloat16


def test_mla_properties() -> None:
    lay = KVLayout(61, 1, 576, "bfloat16", block_size=64, mla=True)
    assert lay.planes == 1 and lay.hidden_size == 576 and lay.block_size == 64


@pytest.mark.parametrize(
    ("given", "want"),
    [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), ("half", torch.float16),
     (torch.float8_e4m3fn, torch.float8_e4m3fn), ("float8_e5m2", torch.float8_e5m2),
     ("float32", torch.float32), ("float64", torch.float64), ("int8", torch.int8),
     (" uint8 ", torch.uint8)],
)
def test_dtype_normalized(given: Any, want: torch.dtype) -> None:
    lay = KVLayout(2, 2, 64, given)
    assert lay.dtype is want and lay.itemsize == want.itemsize
    assert lay.dtype_str == str(want).removeprefix("torch.")


def test_supported_dtypes_listed() -> None:
    assert len(SUPPORTED_DTYPES) == 8
    assert all(normalize_dtype(d) is d for d in SUPPORTED_DTYPES)


@pytest.mark.parametrize("dtype", ["bfloat17", "Tensor", "int32", torch.complex64, "bool"])
def test_unsupported_dtype(dtype: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"dtype: expected one of bfloat16, .*got"):
        KVLayout(2, 2, 64, dtype)


@pytest.mark.parametrize("dtype", [5, None, [torch.float16], object()])
def test_dtype_wrong_type(dtype: Any) -> None:
    with pytest.raises(InvalidTypeError, match=r"dtype: expected a torch.dtype or its name"):
        KVLayout(2, 2, 64, dtype)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_counts(field: str, value: int) -> None:
    kwargs: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
                              "dtype": "bfloat16", field: value}
    with pytest.raises(InvalidArgumentError, match=rf"{field}: expected an int >= 1, got {value}"):
        KVLayout(**kwargs)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
@pytest.mark.parametrize("value", [True, "4", 4.0, None])
def test_wrong_type_counts(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
                              "dtype": "bfloat16", field: value}
    with pytest.raises(InvalidTypeError, match=rf"{field}: expected an int >= 1, got"):
        KVLayout(**kwargs)


def test_index_like_counts_become_int() -> None:
    class Idx:
        def __index__(self) -> int:
            return 4

    lay = KVLayout(Idx(), 2, 64, "bfloat16")  # type: ignore[arg-type]
    assert lay.num_layers == 4 and type(lay.num_layers) is int


def test_mla_requires_one_head() -> None:
    with pytest.raises(InvalidArgumentError, match=r"num_kv_heads: .*expected 1\), got 8"):
        KVLayout(4, 8, 128, "bfloat16", mla=True)


def test_mla_flag_must_be_bool() -> None:
    with pytest.raises(InvalidTypeError, match="mla: expected a bool, got int"):
        KVLayout(4, 1, 576, "bfloat16", mla=1)  # type: ignore[arg-type]


def test_errors_are_sdk_errors() -> None:
    with pytest.raises(KVCacheSDKError):
        KVLayout(0, 1, 1, "bfloat16")
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, "bfloat16")


def test_frozen_equal_hashable() -> None:
    a = KVLayout(4, 8, 128, "bfloat16")
    b = KVLayout(4, 8, 128, torch.bfloat16)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_layers = 5  # type: ignore[misc]


# ---------------------------------------------------------------------- geometry
def test_shard_hidden() -> None:
    lay = KVLayout(4, 8, 128, "bfloat16")
    assert [lay.shard_hidden(w) for w in (1, 2, 4, 8)] == [1024, 512, 256, 128]
    with pytest.raises(InvalidArgumentError, match=r"world_size: expected a divisor of "
                                                   r"num_kv_heads 8 .*got 3"):
        lay.shard_hidden(3)
    with pytest.raises(InvalidArgumentError, match="world_size: expected an int >= 1, got 0"):
        lay.shard_hidden(0)
    with pytest.raises(InvalidTypeError, match="world_size"):
        lay.shard_hidden("2")  # type: ignore[arg-type]


def test_shard_hidden_mla_replicated() -> None:
    lay = KVLayout(4, 1, 576, "bfloat16", mla=True)
    assert lay.shard_hidden(1) == lay.shard_hidden(3) == 576


def test_tensor_and_chunk_shapes() -> None:
    lay = KVLayout(4, 8, 128, "bfloat16")
    assert lay.tensor_shape(300) == (2, 4, 300, 1024)
    assert lay.tensor_shape(0) == (2, 4, 0, 1024)
    assert lay.chunk_shape(256) == (2, 4, 256, 1024)
    assert lay.chunk_shape(256, world_size=2) == (2, 4, 256, 512)
    mla = KVLayout(3, 1, 576, "bfloat16", mla=True)
    assert mla.tensor_shape(10) == (3, 10, 576)
    assert mla.chunk_shape(256, world_size=2) == (3, 256, 576)
    with pytest.raises(InvalidArgumentError, match="tokens: expected an int >= 0, got -1"):
        lay.tensor_shape(-1)
    with pytest.raises(InvalidArgumentError, match="chunk_size: expected an int >= 1"):
        lay.chunk_shape(0)


def test_describe() -> None:
    text = KVLayout(4, 8, 128, "bfloat16").describe()
    assert "4 layers" in text and "8 KV heads x 128" in text and "D 1024" in text
    assert "[2, 4, T, 1024]" in text and "bfloat16" in text and "block_size 16" in text
    mla = KVLayout(3, 1, 576, "float16", mla=True).describe()
    assert "MLA" in mla and "[3, T, 576]" in mla and "1 plane" in mla


def test_diff() -> None:
    a = KVLayout(4, 8, 128, "bfloat16")
    assert a.diff(KVLayout(4, 8, 128, torch.bfloat16)) == []
    d = a.diff(KVLayout(5, 8, 64, "float16", block_size=32))
    assert d == ["num_layers: 4 != 5", "head_dim: 128 != 64", "dtype: bfloat16 != float16",
                 "block_size: 16 != 32"]
    d.append("caller may extend it")
    assert a.diff(KVLayout(5, 8, 64, "float16", block_size=32))[-1] == "block_size: 16 != 32"
    assert KVLayout(4, 1, 576, "bfloat16", mla=True).diff(KVLayout(4, 1, 576, "bfloat16")) == [
        "mla: True != False"
    ]
    with pytest.raises(InvalidTypeError, match="other: expected a KVLayout"):
        a.diff("layout")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- from_decoded
def test_from_decoded_single_shard() -> None:
    lay = KVLayout.from_decoded(decode_status_entry(entry(), 256))
    assert lay == KVLayout(4, 8, 128, "bfloat16", block_size=16)
    assert lay.diff(KVLayout(4, 8, 128, "bfloat16")) == []


def test_from_decoded_tensor_parallel_totals_heads() -> None:
    dec = decode_status_entry(entry(shape="4 x [2, 64, 16, 4, 128]", d=512, world_size=2), 256)
    lay = KVLayout.from_decoded(dec)
    assert lay.num_kv_heads == 8 and lay.shard_hidden(2) == dec.require_single_group().hidden_size
    assert KVLayout.from_decoded(dec, world_size=2) == lay


def test_from_decoded_world_size_disagreement() -> None:
    dec = decode_status_entry(entry(world_size=2), 256)
    with pytest.raises(InvalidArgumentError, match="has world_size 2, got 1"):
        KVLayout.from_decoded(dec, world_size=1)


def test_from_decoded_mla_replicated() -> None:
    dec = decode_status_entry(
        entry("NL_X_NB_BS_HS", "3 x [10, 16, 576]", kv=1, d=576, layers=3, world_size=2,
              is_mla=True), 256,
    )
    lay = KVLayout.from_decoded(dec)
    assert lay == KVLayout(3, 1, 576, "bfloat16", mla=True)
    assert lay.chunk_shape(256, 2) == dec.require_single_group().shape


def test_from_decoded_fused_single_plane() -> None:
    fmt = "NL_X_NB_NH_BS_CS"
    dec = decode_status_entry(entry(fmt, f"Unknown (EngineKVFormat.{fmt})", kv=1, d=512), 256)
    lay = KVLayout.from_decoded(dec)
    assert (lay.planes, lay.hidden_size, lay.num_kv_heads) == (1, 512, 1)
    assert lay.chunk_shape(256) == dec.require_single_group().shape
    dec2 = decode_status_entry(
        entry(fmt, f"Unknown (EngineKVFormat.{fmt})", kv=1, d=512, world_size=2), 256
    )
    with pytest.raises(KVCacheSDKError, match="single-plane, head-sharded format"):
        KVLayout.from_decoded(dec2)


def test_from_decoded_refuses_hybrid() -> None:
    dec = decode_status_entry(entry(groups=2), 256)
    with pytest.raises(KVCacheSDKError, match="hybrid KV layout with 2 kernel groups"):
        KVLayout.from_decoded(dec)
