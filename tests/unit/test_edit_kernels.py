"""The native edit kernels against the torch code they replace (csrc/window_scores.cpp,
rope_gather.cpp, score_pool.cpp; lmcache_kv_fast/copy/edit_kernels.py).

Every kernel is compared with the torch path of the same edit function on the same
inputs — each path of the window scores this CPU runs (AMX, AVX512-BF16, the portable
loop) — and fed bad spans, indices and arguments, which must raise before anything is
written.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

import pytest
import torch
from fused_support import assert_bits_as_torch, edge_rotation, edge_values

from lmcache_kv_fast import _native, edits
from lmcache_kv_fast.copy import edit_kernels as ek
from lmcache_kv_fast.copy.rotate_pairs import rotate_pairs
from lmcache_kv_fast.edits._rerotate import gather_rerotated, rerotate
from lmcache_kv_fast.edits._scores import _window_torch, pool

ALL_ISAS = ("generic", "avx512", "amx")


def _runnable(name: str) -> bool:
    """Whether the core lets ``name`` be forced here (the CPU runs that path)."""
    try:
        _native._set_window_scores_isa(name)
        return True
    except ValueError:
        return False
    finally:
        _native._set_window_scores_isa("auto")


ISAS = [name for name in ALL_ISAS if _runnable(name)]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each window-scores path this machine runs (AMX, AVX-512 where the CPU has them)."""
    _native._set_window_scores_isa(request.param)
    try:
        yield request.param
    finally:
        _native._set_window_scores_isa("auto")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


# (layers, tokens, kv heads, group, head_dim, window, at_end)
SCORE_CASES = [
    (2, 64, 2, 4, 64, 16, True),     # whole tiles
    (3, 37, 2, 3, 32, 5, True),      # ragged rows and keys
    (2, 100, 1, 2, 128, 7, False),   # queries after the KV: every key visible
    (2, 50, 2, 2, 80, 9, True),      # head_dim AMX cannot take: AVX-512 or portable
    (1, 300, 4, 1, 96, 33, True),    # no GQA, three k steps, window past a tile
    (2, 16, 1, 8, 64, 16, True),     # window = the whole KV
    (1, 1, 1, 1, 64, 1, True),       # one token
    (1, 200, 1, 2, 256, 4, True),    # head_dim 256: AVX-512 or the portable loop
    (1, 45, 2, 3, 6, 3, False),      # head_dim 6: AVX-512's pairs without a 32-dim tile
    (1, 40, 1, 2, 7, 2, True),       # odd head_dim: the portable loop on every CPU
]


@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: "x".join(map(str, c)))
def test_window_scores_match_torch(case: tuple, isa: str) -> None:
    layers, count, n_kv, g, hd, window, at_end = case
    k = _bf16(layers, count, n_kv * hd, seed=1)
    q = _bf16(layers, window + 3, n_kv * g * hd, seed=2)
    scale = hd ** -0.5
    ref = _window_torch(q, k, hd, window, at_end, scale, g)
    got = ek.window_scores(q, k, hd, n_kv, window, at_end=at_end, scale=scale, portable=True)
    assert got is not None and got.shape == ref.shape and got.dtype == torch.float32
    # each output sums `window` probabilities: float32 rounding of sums and exps only
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-7)


def test_window_scores_large_logits(isa: str) -> None:
    """Logits far from 0 (scaled keys): the max shift keeps every softmax finite."""
    k = _bf16(1, 70, 64, seed=3) * 40
    q = _bf16(1, 8, 4 * 64, seed=4) * 40
    ref = _window_torch(q, k, 64, 8, True, 0.125, 4)
    got = ek.window_scores(q, k, 64, 1, 8, at_end=True, scale=0.125, portable=True)
    assert got is not None and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # each query head sums 8 softmax rows: 8 in total
    torch.testing.assert_close(got.sum(-1), torch.full((1, 4), 8.0), rtol=1e-5, atol=0)


def test_window_scores_declines_what_it_cannot_run() -> None:
    k, q = _bf16(1, 20, 64, seed=5), _bf16(1, 4, 128, seed=6)
    assert ek.window_scores(q.float(), k, 64, 1, 4, at_end=True, scale=0.1) is None
    assert ek.window_scores(q, k.float(), 64, 1, 4, at_end=True, scale=0.1) is None
    assert ek.window_scores(q[:, ::2], k, 64, 1, 2, at_end=True, scale=0.1) is None
    assert ek.window_scores(q, k, 64, 1, 4, at_end=True, scale=0.0) is None
    assert ek.window_scores(q, k, 48, 1, 4, at_end=True, scale=0.1) is None


@pytest.mark.parametrize("bad", [
    dict(window=0), dict(window=5), dict(at_end=True, tokens=3), dict(scale=-1.0),
    dict(scale=math.inf), dict(n_kv=0), dict(q_bytes=-2), dict(k_bytes=-2), dict(out_bytes=-4),
])
def test_window_scores_rejects_bad_arguments(bad: dict) -> None:
    k, q = _bf16(1, 20, 64, seed=7), _bf16(1, 4, 128, seed=8)
    out = torch.full((1, 2, 20), 7.0)
    tokens = bad.get("tokens", 20)
    spans = []
    for t, name in ((q, "q_bytes"), (k, "k_bytes"), (out, "out_bytes")):
        base, nbytes, off = ek._span(t)
        spans.append((base, nbytes + bad.get(name, 0), off))
    with pytest.raises(ValueError, match="window_scores"):
        _native.window_scores(*spans, 1, tokens, 4, bad.get("n_kv", 1), 2, 64,
                              bad.get("window", 4), bad.get("at_end", True),
                              bad.get("scale", 0.125))
    assert bool((out == 7.0).all())  # nothing written


def test_window_scores_isa_names() -> None:
    assert ek.window_scores_isa() == ISAS[-1]  # the fastest this CPU runs
    assert ek.window_scores_isa(7) == "generic"  # odd head sizes: no fast path
    with pytest.raises(ValueError, match="isa must be"):
        _native._set_window_scores_isa("avx9")


def test_amx_tiles_take_their_shapes() -> None:
    """The tile shapes the AMX paths load are theirs whatever the stack held (a config
    built on the stack once lost its stores to GCC 12's ``_tile_loadconfig`` and loaded
    garbage: a #GP in window_scores, or wrong shapes)."""
    got = _native._amx_tile_shapes()
    if "amx" not in ISAS:
        assert got is None
        return
    palette = bytes([1]) + bytes(15)
    colsb = struct.pack("<16H", *([64] * 8 + [0] * 8))  # 64 bytes a row, tiles 0..7
    rows = bytes([16] * 8 + [0] * 8)
    assert got == palette + colsb + rows


@pytest.mark.parametrize("name", ALL_ISAS)
def test_forcing_window_scores_isa(name: str) -> None:
    """A forced isa caps the path (AMX heads it cannot take go to AVX-512); one this CPU
    cannot run is refused and leaves the setting alone."""
    if name not in ISAS:
        with pytest.raises(ValueError, match="cannot run"):
            _native._set_window_scores_isa(name)
        assert ek.window_scores_isa() == ISAS[-1]
        return
    _native._set_window_scores_isa(name)
    try:
        assert ek.window_scores_isa() == name
        assert ek.window_scores_isa(64) == name
        below = "avx512" if "avx512" in ISAS and name != "generic" else "generic"
        assert ek.window_scores_isa(80) == below
        assert ek.window_scores_isa(7) == "generic"
    finally:
        _native._set_window_scores_isa("auto")


def test_window_scores_declines_the_portable_loop(isa: str) -> None:
    """Without ``portable`` the edits get None (torch runs) where only the slow loop could
    run this head size; a fast path runs."""
    k, q = _bf16(1, 20, 64, seed=5), _bf16(1, 4, 128, seed=6)
    got = ek.window_scores(q, k, 64, 1, 4, at_end=True, scale=0.1)
    assert (got is None) == (isa == "generic")
    k7, q7 = _bf16(1, 20, 7, seed=5), _bf16(1, 4, 14, seed=6)
    assert ek.window_scores(q7, k7, 7, 1, 4, at_end=True, scale=0.1) is None
    assert ek.window_scores(q7, k7, 7, 1, 4, at_end=True, scale=0.1, portable=True) is not None


# ------------------------------------------------------------------ rope_gather
def _rope(**extra: object) -> edits.RoPE:
    cfg = {"model_type": "llama", "head_dim": 64, "rope_theta": 500000.0, **extra}
    return edits.rope_from_config(cfg)


ROPES = {
    "default": {},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}},
    "partial": {"partial_rotary_factor": 0.5},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rope_name", list(ROPES))
@pytest.mark.parametrize("interleaved", [False, True])
def test_gather_rerotated_matches_torch(dtype: torch.dtype, rope_name: str,
                                        interleaved: bool) -> None:
    import dataclasses

    rope = dataclasses.replace(_rope(**ROPES[rope_name]), interleaved=interleaved)
    kv = (torch.randn(2, 3, 300, 4 * 64, generator=torch.Generator().manual_seed(9)) * 3
          ).to(dtype)
    idx = torch.tensor(sorted(set(range(0, 300, 3)) | {299, 1, 2}), dtype=torch.int64)
    ref = kv.index_select(2, idx)
    rerotate(ref, idx, rope, inplace=True)
    got = gather_rerotated(kv, idx, rope)
    assert got.shape == ref.shape and got.dtype == dtype
    assert torch.equal(got[1], ref[1])  # V moved unchanged
    if rope.rotary_dim < rope.head_dim:  # the non-rotary dims too
        tail = got[0].view(3, -1, 4, 64)[..., rope.rotary_dim:]
        assert torch.equal(tail, ref[0].view(3, -1, 4, 64)[..., rope.rotary_dim:])
    assert torch.equal(got, ref)  # torch's order of float32 operations: bit for bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary", [64, 32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gather_rotation_rounds_as_torch(dtype: torch.dtype, rotary: int,
                                         interleaved: bool) -> None:
    """rope_gather rounds as torch: ties to even, denormal inputs and results kept (the
    BF16 instructions would flush them), the denormal range's top rounding up to the
    smallest normal, +-0, overflows to infinity, infinities and NaNs (payloads aside)."""
    kv = edge_values((2, 3, 200, 4 * 64), dtype, seed=4)
    idx = torch.tensor(sorted(set(range(0, 200, 3)) | {199, 1, 2}), dtype=torch.int64)
    rot = edge_rotation(idx.numel(), 64, rotary, interleaved, seed=6)
    got = ek.gather_tokens(kv, idx, rot)
    ref = kv.index_select(2, idx)
    k = ref[0].view(3, idx.numel(), 4, 64)
    x1, x2 = (k[..., 0:rotary:2], k[..., 1:rotary:2]) if interleaved else \
        (k[..., :rotary // 2], k[..., rotary // 2:rotary])
    rotate_pairs(x1, x2, rot.cos[:, None, :], rot.sin[:, None, :])
    assert got is not None
    assert_bits_as_torch(got, ref, "rope_gather")
    assert bool(((ref != 0) & (ref.float().abs() < 2**-126)).any()), "no denormal tested"


def test_plain_gather_is_index_select() -> None:
    kv = _bf16(2, 4, 100, 128, seed=10)
    idx = torch.tensor([0, 5, 6, 7, 50, 99], dtype=torch.int64)
    got = ek.gather_tokens(kv, idx)
    assert got is not None and torch.equal(got, kv.index_select(2, idx))
    assert ek.gather_tokens(kv, idx[:0]).shape == (2, 4, 0, 128)


def _rope_gather(out: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, rotary: int = 64, head: int = 64, rows: int | None = None,
                 shrink: str = "") -> None:
    spans = []
    for t, name in ((out, "dst"), (kv, "src"), (idx, "idx"), (cos, "cos"), (sin, "sin")):
        base, nbytes, off = ek._span(t)
        spans.append((base, nbytes - (4 if shrink == name else 0), off))
    _native.rope_gather(*spans, 2, kv.shape[1], rows or kv.shape[2], idx.numel(),
                        kv.shape[3], head, rotary, False, "bfloat16")


@pytest.mark.parametrize("bad", ["index", "negative", "dst", "src", "idx", "cos", "odd",
                                 "wide", "overlap", "heads"])
def test_rope_gather_rejects_before_writing(bad: str) -> None:
    kv = _bf16(2, 2, 10, 128, seed=11)
    idx = torch.tensor([1, 3, 10 if bad == "index" else 4, -1 if bad == "negative" else 5])
    out = torch.full((2, 2, 4, 128), 3.0, dtype=torch.bfloat16)
    cos, sin = torch.ones(4, 32), torch.zeros(4, 32)
    kw: dict = {"shrink": bad if bad in ("dst", "src", "idx", "cos") else ""}
    if bad == "odd":
        kw["rotary"] = 63
    if bad == "wide":
        kw["rotary"] = 66
    if bad == "heads":
        kw["head"] = 48
    if bad == "overlap":
        before = kv.clone()
        with pytest.raises(ValueError, match="overlaps"):
            _rope_gather(kv, kv, idx, cos, sin)
        assert torch.equal(kv, before)
        return
    with pytest.raises(ValueError, match="rope_gather"):
        _rope_gather(out, kv, idx, cos, sin, **kw)
    assert bool((out.float() == 3.0).all())


# ------------------------------------------------------------------ score_pool
@pytest.mark.parametrize("how", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7, 15])
@pytest.mark.parametrize("n", [0, 2, 40, 50])
def test_pool_scores_matches_torch(how: str, kernel: int, n: int) -> None:
    x = torch.rand(3, 5, 50, generator=torch.Generator().manual_seed(kernel + n))
    ref = x.clone()
    if n:
        ref[..., :n] = pool(x[..., :n].contiguous(), kernel, how)
    got = x.clone()
    assert ek.pool_scores(got, n, kernel, how)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


def test_pool_scores_rejects() -> None:
    x = torch.rand(2, 10)
    assert not ek.pool_scores(x.double(), 5, 3, "max")
    assert not ek.pool_scores(x[:, ::2], 5, 3, "max")
    assert not ek.pool_scores(x, 11, 3, "max")
    with pytest.raises(ValueError, match="kernel must be odd"):
        ek.pool_scores(x, 5, 4, "max")


# ------------------------------------------------------------------ the edits, end to end
def _torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ek, "_native", lambda: None)


@pytest.mark.parametrize("method", ["snapkv", "rkv", "drop_every", "key_norm"])
def test_edits_keep_the_same_tokens_native_or_torch(method: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The edit picks the same tokens and writes the same bytes either way."""
    rope = _rope(**ROPES["llama3"])
    kv = _bf16(2, 4, 512, 2 * 64, seed=12)
    q = _bf16(4, 16, 8 * 64, seed=13)
    fn = {"snapkv": lambda: edits.snapkv(q, 16, 7, ratio=0.4, rope=rope),
          "rkv": lambda: edits.rkv(q, 8, 5, ratio=0.4, rope=rope),
          "drop_every": lambda: edits.drop_every(3, rope=rope),
          "key_norm": lambda: edits.key_norm(0.5, rope=rope)}[method]()
    tokens = list(range(1000, 1512))
    out_n, tok_n = fn(kv, tokens)
    _torch_only(monkeypatch)
    out_t, tok_t = fn(kv, tokens)
    assert tok_n == tok_t
    assert torch.equal(out_n[1], out_t[1])
    assert torch.equal(out_n, out_t)


# ------------------------------------------------------------------ key_redundancy
# (its path follows the window scores' isa: the fixture forces each)
def _torch_redundancy(k: torch.Tensor, hd: int, thr: float,
                      monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    from lmcache_kv_fast.edits import _scores

    with monkeypatch.context() as m:
        m.setattr(ek, "key_redundancy", lambda *a, **kw: None)
        return _scores.redundancy(k, hd, thr)


@pytest.mark.parametrize("case", [(2, 37, 2, 64, 0.5), (3, 300, 2, 128, 0.1),
                                  (1, 17, 1, 32, -0.2), (2, 64, 4, 96, 0.3), (1, 1, 1, 64, 0.5)],
                         ids=lambda c: "x".join(map(str, c)))
def test_key_redundancy_matches_torch(case: tuple, isa: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX (every pair) and AVX-512 (the pairs above the diagonal, counted for both keys)
    against torch's strips; no portable loop: with ``generic`` forced it declines."""
    from lmcache_kv_fast.edits._scores import redundancy

    layers, count, n_kv, hd, thr = case
    gen = torch.Generator().manual_seed(count)
    k = torch.randn(layers, count, n_kv * hd, generator=gen)
    k[..., :hd] += 2 * torch.randn(1, 1, hd, generator=gen)  # near-duplicates in head 0
    k = k.to(torch.bfloat16)
    sums = ek.key_redundancy(k, hd, thr)
    assert _native.key_redundancy_supported(hd) == (isa != "generic")
    if isa == "generic":
        assert sums is None  # the torch code runs instead
        return
    assert sums is not None and sums.shape == (layers, n_kv, count)
    ref = _torch_redundancy(k, hd, thr, monkeypatch)
    torch.testing.assert_close(redundancy(k, hd, thr), ref, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("case", [(2, 37, 2, 64, 0.5), (1, 400, 2, 80, 0.05),
                                  (1, 77, 1, 6, 0.2), (1, 50, 2, 32, -0.3)],
                         ids=lambda c: "x".join(map(str, c)))
def test_key_redundancy_sums_match_float64(case: tuple, isa: str) -> None:
    """The raw sums (before the softmax that flattens differences) against float64 math:
    head sizes past the packing's 32-dim tiles (80, 6) and a negative threshold (the
    pair with itself never counts)."""
    layers, count, n_kv, hd, thr = case
    gen = torch.Generator().manual_seed(count + hd)
    k = torch.randn(layers, count, n_kv * hd, generator=gen)
    k[..., :hd] += 2 * torch.randn(1, 1, hd, generator=gen)
    k = k.to(torch.bfloat16)
    sums = ek.key_redundancy(k, hd, thr)
    if isa == "generic":
        assert sums is None
        return
    kh = torch.nn.functional.normalize(
        k.double().view(layers, count, n_kv, hd).transpose(1, 2), dim=-1)
    sim = kh @ kh.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    ref = torch.where(sim > thr, sim, torch.zeros(())).sum(-1)
    assert sums is not None
    torch.testing.assert_close(sums.double(), ref, rtol=1e-5, atol=1e-5)


def test_key_redundancy_declines_and_rejects() -> None:
    k = _bf16(1, 20, 128, seed=14)
    assert ek.key_redundancy(k.float(), 64, 0.5) is None
    assert ek.key_redundancy(k, 48, 0.5) is None  # not a whole number of heads
    assert ek.key_redundancy(k[:, ::2], 64, 0.5) is None
    if not _native.key_redundancy_supported(64):
        return
    out = torch.full((1, 2, 20), 5.0)
    k_span, o_span = ek._span(k), ek._span(out)
    with pytest.raises(ValueError, match="key_redundancy: k needs bytes"):
        _native.key_redundancy((k_span[0], k_span[1] - 2, 0), o_span, 1, 20, 2, 64, 0.5)
    with pytest.raises(ValueError, match="key_redundancy: out needs bytes"):
        _native.key_redundancy(k_span, (o_span[0], o_span[1] - 4, 0), 1, 20, 2, 64, 0.5)
    with pytest.raises(ValueError, match="head_dim"):
        _native.key_redundancy(k_span, o_span, 1, 20, 2, 33, 0.5)  # odd: no fast path
    assert bool((out == 5.0).all())


# ------------------------------------------------------------------ key_scores
@pytest.mark.parametrize("method", ["keydiff", "l2"])
@pytest.mark.parametrize("case", [(2, 37, 2, 64), (3, 300, 2, 128), (1, 1, 1, 32), (2, 20, 2, 80),
                                  (2, 20, 1, 24)], ids=lambda c: "x".join(map(str, c)))
def test_key_scores_match_torch(case: tuple, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both the AVX-512 path (head sizes of 16s) and the portable one (24)."""
    from lmcache_kv_fast.edits import _scores

    layers, count, n_kv, hd = case
    gen = torch.Generator().manual_seed(count + hd)
    k = (torch.randn(layers, count, n_kv * hd, generator=gen) * 2 + 0.3).to(torch.bfloat16)
    got = ek.key_scores(k, hd, method)
    assert got is not None and got.shape == (layers, n_kv, count)
    with monkeypatch.context() as m:
        m.setattr(ek, "key_scores", lambda *a: None)
        ref = _scores.key_scores(k, hd, method)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_key_scores_rejects() -> None:
    k = _bf16(1, 20, 128, seed=15)
    assert ek.key_scores(k.float(), 64, "l2") is None
    assert ek.key_scores(k, 48, "l2") is None
    assert ek.key_scores(k, 64, "cosine") is None
    out = torch.full((1, 2, 20), 5.0)
    k_span, o_span = ek._span(k), ek._span(out)
    with pytest.raises(ValueError, match="key_scores: k needs bytes"):
        _native.key_scores((k_span[0], k_span[1] - 2, 0), o_span, 1, 20, 2, 64, True)
    with pytest.raises(ValueError, match="key_scores: out overlaps k"):
        _native.key_scores(k_span, k_span, 1, 20, 2, 64, True)
    assert bool((out == 5.0).all())


def test_kernels_from_many_threads_agree() -> None:
    """Callers racing for the copy pool (a busy pool runs the job on the caller's thread,
    with that thread's own scratch): every result equals the one computed alone."""
    from concurrent.futures import ThreadPoolExecutor

    k, q = _bf16(4, 700, 2 * 64, seed=16), _bf16(4, 24, 8 * 64, seed=17)
    kv = _bf16(2, 4, 700, 2 * 64, seed=18)
    idx = torch.arange(0, 700, 3, dtype=torch.int64)
    rot = ek.Rotation(torch.rand(idx.numel(), 32), torch.rand(idx.numel(), 32), 64, 64, False)

    def run() -> tuple[torch.Tensor, ...]:
        s = ek.window_scores(q, k, 64, 2, 24, at_end=True, scale=0.125, portable=True)
        g = ek.gather_tokens(kv, idx, rot)
        assert s is not None and g is not None
        return s.clone(), g.clone()

    alone = run()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: run(), range(16)))
    for s, g in results:
        assert torch.equal(g, alone[1])
        torch.testing.assert_close(s, alone[0], rtol=0, atol=0)
