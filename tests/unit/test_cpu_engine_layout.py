"""CpuEngineKV: a CPU vLLM engine's raw rows <-> per-token K/V, against a literal transcription
of vLLM 0.32.0's ``reshape_and_cache`` (csrc/cpu/cpu_attn_vec.hpp, cpu_attn_amx.hpp).

The live check against the installed vLLM kernel itself is tests/engine/test_kernel_layouts.py.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_kv_fast import InvalidArgumentError, InvalidTypeError, KVLayout
from lmcache_kv_fast.layout import (
    CpuEngineKV,
    UnsupportedEngineLayoutError,
    raw_rows_from_paged_blocks,
    select_cpu_kernel,
)


def reference_cache(kernel: str, k: torch.Tensor, v: torch.Tensor, bs: int) -> torch.Tensor:
    """Paged cache ``[NB, NH, BS, 2*HS]`` written token by token like vLLM's C++ does.

    ``k``/``v``: ``[T, NH, HS]`` with T = NB * BS (slot t = token t).
    """
    tokens, nh, hs = k.shape
    nb = tokens // bs
    cache = torch.zeros(nb, nh, bs * 2 * hs, dtype=k.dtype)
    for t in range(tokens):
        blk, off = divmod(t, bs)
        for h in range(nh):
            region = cache[blk, h]
            kc, vc = region[: bs * hs], region[bs * hs:]
            if kernel in ("vec", "vec16"):
                for i in range(hs):  # key_cache_start_ptr[j] with j = i * block_size
                    kc[off + i * bs] = k[t, h, i]
                vc[off * hs: off * hs + hs] = v[t, h]  # memcpy at block_offset * head_dim
            else:  # amx, bf16: int32 "quadwords" of 2 elements
                group_idx, group_off = divmod(off, 16)
                q0 = group_idx * 16 * (hs // 2) + group_off
                for j in range(hs // 2):  # key_cache_start_ptr[i], i = j * 16 (int32 units)
                    kc[2 * (q0 + 16 * j): 2 * (q0 + 16 * j) + 2] = k[t, h, 2 * j: 2 * j + 2]
                sub_idx, sub_off = divmod(off, 2)
                start = sub_idx * 2 * 16 + sub_off
                for i in range(hs // 16):
                    for j in range(16):
                        vc[start + i * bs * 16 + 2 * j] = v[t, h, i * 16 + j]
    return cache.view(nb, nh, bs, 2 * hs)


def rand_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs included) of ``dtype``, to prove copies are bit-exact."""
    g = torch.Generator().manual_seed(seed)
    ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=ints).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


GEOMETRIES = [
    # kernel, layers, kv heads, head size, block size, dtype
    ("vec", 2, 2, 64, 128, torch.bfloat16),     # the tiny model (one strided copy)
    ("vec", 1, 3, 32, 32, torch.float32),
    ("vec", 2, 1, 96, 64, torch.float16),
    ("vec", 1, 2, 128, 256, torch.bfloat16),
    ("vec16", 2, 2, 80, 32, torch.bfloat16),     # HS % 32 != 0 -> vec16
    ("vec16", 1, 2, 80, 48, torch.float32),      # two-copy path
    ("vec16", 1, 1, 112, 16, torch.float32),
    ("amx", 2, 2, 64, 128, torch.bfloat16),
    ("amx", 1, 1, 96, 32, torch.bfloat16),       # two-copy path
    ("amx", 1, 2, 128, 64, torch.bfloat16),
]


@pytest.mark.parametrize(("kernel", "layers", "nh", "hs", "bs", "dtype"), GEOMETRIES)
def test_matches_vllm_reshape_and_cache_transcription(kernel, layers, nh, hs, bs, dtype):
    spec = CpuEngineKV(layers, nh, hs, dtype, bs, kernel)
    tokens = 2 * bs
    kv = rand_bits((2, layers, tokens, nh * hs), dtype, seed=hs + bs)
    raw = spec.to_raw(kv)
    assert raw.shape == (layers, tokens, nh * 2 * hs)
    for layer in range(layers):
        k = kv[0, layer].view(tokens, nh, hs)
        v = kv[1, layer].view(tokens, nh, hs)
        want = raw_rows_from_paged_blocks(reference_cache(kernel, k, v, bs)[None])
        assert same_bits(raw[layer], want[0]), f"{kernel} layer {layer}"
    assert same_bits(spec.to_tokens(raw), kv)


@pytest.mark.parametrize(("kernel", "layers", "nh", "hs", "bs", "dtype"), GEOMETRIES)
def test_round_trip_is_bit_exact(kernel, layers, nh, hs, bs, dtype):
    spec = CpuEngineKV(layers, nh, hs, dtype, bs, kernel)
    raw = rand_bits((layers, 3 * bs, nh * 2 * hs), dtype, seed=7)
    out = torch.empty(2, layers, 3 * bs, nh * hs, dtype=dtype)
    assert spec.to_tokens(raw, out=out) is out
    back = torch.empty_like(raw)
    assert spec.to_raw(out, out=back) is back
    assert same_bits(back, raw)
    # a non-contiguous input is accepted (copied first)
    wide = torch.cat([raw, raw], dim=2)[:, :, : raw.shape[2]]
    assert not wide.is_contiguous()
    assert same_bits(spec.to_tokens(wide), out)


@pytest.mark.parametrize(("kernel", "layers", "nh", "hs", "bs", "dtype"),
                         [g for g in GEOMETRIES if g[4] <= 64 or g[0] == "vec"][:6])
def test_token_slices_in_place(kernel, layers, nh, hs, bs, dtype):
    """Chunk by chunk into / out of a token slice of a larger tensor (what retrieve / store do)."""
    spec = CpuEngineKV(layers, nh, hs, dtype, bs, kernel)
    kv = rand_bits((2, layers, 4 * bs, nh * hs), dtype, seed=3)
    raw = spec.to_raw(kv)
    out = torch.zeros(2, layers, 5 * bs, nh * hs, dtype=dtype)
    for c in range(2):  # chunks of 2 blocks, written in place
        part = out.narrow(2, c * 2 * bs, 2 * bs)
        assert spec.to_tokens(raw[:, c * 2 * bs:(c + 1) * 2 * bs], out=part) is part
    assert same_bits(out[:, :, : 4 * bs], kv) and not out[:, :, 4 * bs:].any()
    back = torch.empty(layers, 2 * bs, nh * 2 * hs, dtype=dtype)
    for c in range(2):  # and back from token slices (read in place)
        spec.to_raw(out.narrow(2, c * 2 * bs, 2 * bs), out=back)
        assert same_bits(back, raw[:, c * 2 * bs:(c + 1) * 2 * bs])


def test_rows_are_not_tokens():
    """With vec, HS=64, BS=128 a raw row holds one K dimension of 128 tokens, not a token's K|V."""
    spec = CpuEngineKV(1, 1, 64, torch.float32, 128, "vec")
    kv = torch.randn(2, 1, 128, 64)
    raw = spec.to_raw(kv)
    assert torch.equal(raw[0, 5], kv[0, 0, :, 5])  # row 5 = dim 5 of every token's K
    assert torch.equal(raw[0, 64 + 3], torch.cat([kv[1, 0, 6], kv[1, 0, 7]]))  # V of tokens 6, 7


@pytest.mark.parametrize(("kernel", "hs", "bs", "one_copy"), [
    ("vec", 64, 128, True), ("vec16", 80, 32, True), ("amx", 64, 128, True),
    ("vec16", 80, 48, False), ("amx", 96, 32, False)])
def test_both_copy_paths_are_exercised(kernel, hs, bs, one_copy):
    from lmcache_kv_fast.layout.cpu_engine import _plane_digits, _split_for_rows

    fits = all(_split_for_rows(d, 2 * hs) is not None for d in _plane_digits(kernel, bs, hs))
    assert fits is one_copy


def test_layouts():
    spec = CpuEngineKV(2, 2, 64, "bfloat16", 128, "vec")
    assert spec.raw_layout == KVLayout(2, 1, 256, torch.bfloat16, 128, mla=True)
    assert spec.token_layout == KVLayout(2, 2, 64, torch.bfloat16, 128)
    assert CpuEngineKV.from_token_layout(spec.token_layout, "amx").kernel == "amx"
    assert "kernel vec" in spec.describe()
    with pytest.raises(UnsupportedEngineLayoutError, match="MLA"):
        CpuEngineKV.from_token_layout(KVLayout(2, 1, 576, "bfloat16", mla=True), "vec")
    with pytest.raises(InvalidTypeError):
        CpuEngineKV.from_token_layout("x", "vec")  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", ["neon", "vxe", "vsx", "rvv"])
def test_unverified_kernels_refused(kernel):
    with pytest.raises(UnsupportedEngineLayoutError, match="not verified"):
        CpuEngineKV(2, 2, 64, torch.bfloat16, 128, kernel)


def test_bad_kernels_and_geometry_refused():
    with pytest.raises(UnsupportedEngineLayoutError, match="unknown"):
        CpuEngineKV(2, 2, 64, torch.bfloat16, 128, "avx9000")
    with pytest.raises(UnsupportedEngineLayoutError, match="bfloat16"):
        CpuEngineKV(2, 2, 64, torch.float32, 128, "amx")
    with pytest.raises(UnsupportedEngineLayoutError, match="multiples of 32"):
        CpuEngineKV(2, 2, 80, torch.bfloat16, 128, "amx")
    with pytest.raises(InvalidArgumentError):
        CpuEngineKV(0, 2, 64, torch.bfloat16, 128, "vec")


def test_bad_tensors_refused():
    spec = CpuEngineKV(2, 2, 64, torch.bfloat16, 128, "vec")
    raw = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="multiple of the engine block size 128"):
        spec.to_tokens(raw[:, :200])
    with pytest.raises(InvalidArgumentError, match=r"\[L, T, NH\*2\*HS\]"):
        spec.to_tokens(torch.zeros(2, 256, 128, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        spec.to_tokens(raw.float())
    with pytest.raises(InvalidTypeError):
        spec.to_tokens([1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"\[2, L, T, NH\*HS\]"):
        spec.to_raw(raw)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        spec.to_tokens(raw, out=torch.zeros(2, 2, 128, 256, dtype=torch.bfloat16).transpose(2, 3))
    with pytest.raises(InvalidArgumentError, match="contiguous"):  # overlapping tokens
        spec.to_tokens(raw, out=torch.zeros(2, 2, 1, 128, dtype=torch.bfloat16).expand(2, 2, 256, 128))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        spec.to_raw(torch.zeros(2, 2, 256, 128, dtype=torch.bfloat16),
                    out=torch.zeros(2, 256, 512, dtype=torch.bfloat16)[..., :256])
    with pytest.raises(InvalidTypeError):
        spec.to_tokens(raw, out=3)  # type: ignore[arg-type]


def test_select_cpu_kernel_mirrors_vllm():
    bf16 = torch.bfloat16
    assert select_cpu_kernel(bf16, 128, 64, amx=False) == "vec"
    assert select_cpu_kernel(bf16, 128, 64, amx=True) == "amx"
    assert select_cpu_kernel("float32", 128, 64, amx=True) == "vec"
    assert select_cpu_kernel(bf16, 128, 80, amx=True) == "vec16"
    assert select_cpu_kernel(bf16, 16, 64, amx=False) == "vec16"
    assert select_cpu_kernel(bf16, 16, 64, amx=True) == "vec16"
    assert select_cpu_kernel(bf16, 128, 64) in ("vec", "amx")
    with pytest.raises(UnsupportedEngineLayoutError, match="fp8"):
        select_cpu_kernel(bf16, 128, 64, kv_cache_dtype="fp8_e4m3")


def test_raw_rows_from_paged_blocks():
    blocks = torch.arange(2 * 3 * 2 * 4 * 6).view(2, 3, 2, 4, 6)
    rows = raw_rows_from_paged_blocks(blocks)
    assert rows.shape == (2, 12, 12)
    assert torch.equal(rows[1, 5], blocks[1, 1, :, 1, :].reshape(-1))
    with pytest.raises(InvalidArgumentError):
        raw_rows_from_paged_blocks(torch.zeros(3, 3))
