"""Bad input against the real server (SHM and pickle planes): every case is a clear error
that names the argument, raised before anything reaches the server, and leaves nothing
half-written (no session, lock or staged object; a lookup of the tokens returns 0).

What is accepted (and documented by the "accepted" tests):

* tokens: any sequence or iterable of Python / numpy integers, a 1-D integer numpy array or
  torch tensor, a ``range``; each in ``[0, 2**32)``. Refused: bools, floats, strings,
  bytes, None, nested sequences, non-integer or multi-dimensional arrays.
* kv: any strided CPU (or copyable) tensor of the model's dtype and shape, contiguous or
  not (non-contiguous views are copied once). torch has no negative strides: ``flip()``
  returns a copy, stored as-is. ``requires_grad`` tensors are detached. The meta device
  (no data) and sparse layouts are refused.
* KV values are opaque bits: NaN / inf / -0.0 are stored and returned bit-exact.
* out (retrieve): a contiguous, dense, CPU tensor of the model's dtype, not requiring grad,
  with room for the requested whole-chunk tokens. Aliasing: retrieve takes no ``kv`` and
  store takes no ``out``, so there is no in-call aliasing to detect; passing the very
  tensor that was stored as ``out`` is fine (it is overwritten with the same bits).
  Sharing one ``out`` between concurrent retrieves is the caller's race, like any
  in-place write.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Model, make_model, rand_tokens
from rel_helpers import Plane, install_frame_watch, leftovers, open_plane

import lmcache_kv_fast as lkf
from lmcache_kv_fast.testing import LMCacheServer

C = 256
L, NH, HS = 2, 2, 64
D = NH * HS

install_frame_watch()


@pytest.fixture(scope="module", params=["shm", "pickle"])
def plane(request: pytest.FixtureRequest) -> Iterator[Plane]:
    yield from open_plane(request, num_layers=L, num_kv_heads=NH, head_size=HS)


def _kv(t: int = C, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, L, t, D, generator=g).bfloat16()


Case = Callable[[lkf.LMCacheKVCacheContext, list[int]], Any]


class _Str(str):
    """A str subclass (msgspec refuses to encode it)."""


def _quantized(t: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Token ids as a quantized tensor (deprecated in torch, still there)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.tensor(t, dtype=torch.float32), 1.0, 0, dtype)


def _deep(depth: int) -> dict[str, Any]:
    """``{"a": {"a": ... {}}}`` nested ``depth`` deep."""
    d: dict[str, Any] = {}
    for _ in range(depth):
        d = {"a": d}
    return d

# name -> (call(ctx, fresh tokens of 2 chunks), exception type, text the message must contain)
BAD: dict[str, tuple[Case, type[Exception], str]] = {
    # --- kv
    "kv_list": (lambda c, t: c.store(_kv(2 * C).tolist(), t), lkf.InvalidTypeError, "kv"),
    "kv_numpy": (lambda c, t: c.store(_kv(2 * C).float().numpy(), t), lkf.InvalidTypeError, "kv"),
    "kv_none": (lambda c, t: c.store(None, t), lkf.InvalidTypeError, "kv"),
    "kv_rank3": (lambda c, t: c.store(_kv(2 * C)[0], t), lkf.InvalidArgumentError, "kv has shape"),
    "kv_rank5": (lambda c, t: c.store(_kv(2 * C)[None], t), lkf.InvalidArgumentError, "kv has shape"),
    "kv_scalar": (lambda c, t: c.store(torch.tensor(1.0).bfloat16(), t), lkf.InvalidArgumentError,
                  "kv has shape"),
    "kv_three_planes": (lambda c, t: c.store(torch.zeros(3, L, 2 * C, D).bfloat16(), t),
                        lkf.InvalidArgumentError, "kv has shape"),
    "kv_wrong_layers": (lambda c, t: c.store(torch.zeros(2, L + 1, 2 * C, D).bfloat16(), t),
                        lkf.InvalidArgumentError, "kv has shape"),
    "kv_wrong_hidden": (lambda c, t: c.store(torch.zeros(2, L, 2 * C, D // 2).bfloat16(), t),
                        lkf.InvalidArgumentError, "kv has shape"),
    "kv_transposed": (lambda c, t: c.store(_kv(2 * C).transpose(2, 3), t),
                      lkf.InvalidArgumentError, "kv has shape"),
    "kv_float32": (lambda c, t: c.store(_kv(2 * C).float(), t), lkf.InvalidTypeError, "kv has dtype"),
    "kv_float16": (lambda c, t: c.store(_kv(2 * C).half(), t), lkf.InvalidTypeError, "kv has dtype"),
    "kv_int8": (lambda c, t: c.store(torch.zeros(2, L, 2 * C, D, dtype=torch.int8), t),
                lkf.InvalidTypeError, "kv has dtype"),
    "kv_meta_device": (lambda c, t: c.store(torch.empty(2, L, 2 * C, D, dtype=torch.bfloat16,
                                                        device="meta"), t),
                       lkf.InvalidArgumentError, "kv is on device meta"),
    "kv_sparse": (lambda c, t: c.store(_kv(2 * C).float().to_sparse().to(torch.bfloat16), t),
                  lkf.InvalidArgumentError, "kv must be a dense"),
    # --- tokens (store)
    "tokens_one_short": (lambda c, t: c.store(_kv(2 * C), t[:-1]), lkf.InvalidArgumentError,
                         "len(tokens)"),
    "tokens_one_long": (lambda c, t: c.store(_kv(2 * C), [*t, 1]), lkf.InvalidArgumentError,
                        "len(tokens)"),
    "tokens_float": (lambda c, t: c.store(_kv(2 * C), [float(x) for x in t]), lkf.InvalidTypeError,
                     "tokens"),
    "tokens_str": (lambda c, t: c.store(_kv(2 * C), "a" * (2 * C)), lkf.InvalidTypeError, "tokens"),
    "tokens_bytes": (lambda c, t: c.store(_kv(2 * C), bytes(2 * C)), lkf.InvalidTypeError,
                     "tokens"),
    "tokens_none": (lambda c, t: c.store(_kv(2 * C), None), lkf.InvalidTypeError, "tokens"),
    "tokens_int": (lambda c, t: c.store(_kv(2 * C), 512), lkf.InvalidTypeError, "tokens"),
    "tokens_bool": (lambda c, t: c.store(_kv(2 * C), [True] * (2 * C)), lkf.InvalidTypeError,
                    "tokens"),
    "tokens_nested": (lambda c, t: c.store(_kv(2 * C), [[x] for x in t]), lkf.InvalidTypeError,
                      "tokens"),
    "tokens_negative": (lambda c, t: c.store(_kv(2 * C), [-1, *t[1:]]), lkf.InvalidArgumentError,
                        "tokens must be in [0, 2**32)"),
    "tokens_2^32": (lambda c, t: c.store(_kv(2 * C), [*t[:-1], 2**32]), lkf.InvalidArgumentError,
                    "tokens must be in [0, 2**32)"),
    "tokens_2^64": (lambda c, t: c.store(_kv(2 * C), [*t[:-1], 2**64]), lkf.InvalidArgumentError,
                    "tokens must be in [0, 2**32)"),
    "tokens_numpy_float": (lambda c, t: c.store(_kv(2 * C), np.array(t, dtype=np.float64)),
                           lkf.InvalidTypeError, "tokens must have an integer dtype"),
    "tokens_torch_float": (lambda c, t: c.store(_kv(2 * C), torch.tensor(t, dtype=torch.float32)),
                           lkf.InvalidTypeError, "tokens must have an integer dtype"),
    "tokens_torch_bool": (lambda c, t: c.store(_kv(2 * C), torch.ones(2 * C, dtype=torch.bool)),
                          lkf.InvalidTypeError, "tokens must have an integer dtype"),
    "tokens_2d_array": (lambda c, t: c.store(_kv(2 * C), np.array(t).reshape(2, C)),
                        lkf.InvalidArgumentError, "tokens must be 1-D"),
    "tokens_numpy_negative": (lambda c, t: c.store(_kv(2 * C), np.array([-5, *t[1:]])),
                              lkf.InvalidArgumentError, "tokens must be in [0, 2**32)"),
    "tokens_torch_quantized": (lambda c, t: c.store(_kv(2 * C), _quantized(t, torch.qint32)),
                               lkf.InvalidTypeError, "tokens must have an integer dtype"),
    "tokens_torch_meta": (lambda c, t: c.store(_kv(2 * C), torch.empty(2 * C, dtype=torch.int64,
                                                                      device="meta")),
                          lkf.InvalidTypeError, "tokens is a tensor on the meta device"),
    "tokens_numpy_bool_scalars": (lambda c, t: c.store(_kv(2 * C), [np.bool_(True)] * (2 * C)),
                                  lkf.InvalidTypeError, "tokens must contain only ints"),
    "tokens_torch_float_scalars": (lambda c, t: c.store(_kv(2 * C), [torch.tensor(1.5)] * (2 * C)),
                                   lkf.InvalidTypeError, "tokens must contain only ints"),
    "retrieve_tokens_numpy_bool": (lambda c, t: c.retrieve([np.bool_(False)] * (2 * C)),
                                   lkf.InvalidTypeError, "tokens"),
    "lookup_tokens_quantized": (lambda c, t: c.lookup(_quantized(t, torch.quint8)),
                                lkf.InvalidTypeError, "tokens"),
    # --- salt
    "salt_lone_surrogate": (lambda c, t: c.store(_kv(2 * C), t, cache_salt="a\ud800"),
                            lkf.InvalidArgumentError, "cache_salt must be valid Unicode"),
    "salt_str_subclass": (lambda c, t: c.store(_kv(2 * C), t, cache_salt=_Str("tenant")),
                          lkf.InvalidTypeError, "cache_salt must be a str, got a subclass"),
    "retrieve_salt_surrogate": (lambda c, t: c.retrieve(t, cache_salt="\udfff"),
                                lkf.InvalidArgumentError, "cache_salt"),
    "lookup_salt_subclass": (lambda c, t: c.lookup(t, cache_salt=_Str("")),
                             lkf.InvalidTypeError, "cache_salt"),
    # --- request_configs
    "configs_nested_10000": (lambda c, t: c.store(_kv(2 * C), t, request_configs=_deep(10_000)),
                             lkf.InvalidArgumentError, "request_configs is nested too deeply"),
    "retrieve_configs_nested": (lambda c, t: c.retrieve(t, request_configs=_deep(10_000)),
                                lkf.InvalidArgumentError, "request_configs"),
    "lookup_configs_nested": (lambda c, t: c.lookup(t, request_configs=_deep(10_000)),
                              lkf.InvalidArgumentError, "request_configs"),
    "configs_surrogate": (lambda c, t: c.store(_kv(2 * C), t, request_configs={"k": "\ud800"}),
                          lkf.InvalidArgumentError, "request_configs"),
    "salt_slash": (lambda c, t: c.store(_kv(2 * C), t, cache_salt="a/b"), lkf.InvalidArgumentError,
                   "cache_salt"),
    "salt_at": (lambda c, t: c.store(_kv(2 * C), t, cache_salt="a@b"), lkf.InvalidArgumentError,
                "cache_salt"),
    "salt_backslash": (lambda c, t: c.store(_kv(2 * C), t, cache_salt="a\\b"),
                       lkf.InvalidArgumentError, "cache_salt"),
    "salt_nul": (lambda c, t: c.store(_kv(2 * C), t, cache_salt="a\x00b"), lkf.InvalidArgumentError,
                 "cache_salt"),
    "salt_129_chars": (lambda c, t: c.store(_kv(2 * C), t, cache_salt="s" * 129),
                       lkf.InvalidArgumentError, "cache_salt"),
    "salt_bytes": (lambda c, t: c.store(_kv(2 * C), t, cache_salt=b"x"), lkf.InvalidTypeError,
                   "cache_salt"),
    "salt_none": (lambda c, t: c.store(_kv(2 * C), t, cache_salt=None), lkf.InvalidTypeError,
                  "cache_salt"),
    "salt_int": (lambda c, t: c.store(_kv(2 * C), t, cache_salt=7), lkf.InvalidTypeError,
                 "cache_salt"),
    # --- retrieve / lookup arguments
    "retrieve_salt_slash": (lambda c, t: c.retrieve(t, cache_salt="../x"),
                            lkf.InvalidArgumentError, "cache_salt"),
    "retrieve_tokens_negative": (lambda c, t: c.retrieve([-1, *t[1:]]), lkf.InvalidArgumentError,
                                 "tokens"),
    "retrieve_tokens_str": (lambda c, t: c.retrieve("x" * 600), lkf.InvalidTypeError, "tokens"),
    "lookup_tokens_2^32": (lambda c, t: c.lookup([2**32, *t[1:]]), lkf.InvalidArgumentError,
                           "tokens"),
    "lookup_salt_long": (lambda c, t: c.lookup(t, cache_salt="x" * 200), lkf.InvalidArgumentError,
                         "cache_salt"),
    "out_numpy": (lambda c, t: c.retrieve(t, out=np.zeros((2, L, 2 * C, D))),
                  lkf.InvalidTypeError, "out"),
    "out_float32": (lambda c, t: c.retrieve(t, out=torch.zeros(2, L, 2 * C, D)),
                    lkf.InvalidTypeError, "out has dtype"),
    "out_wrong_layers": (lambda c, t: c.retrieve(t, out=torch.zeros(2, L + 1, 2 * C, D).bfloat16()),
                         lkf.InvalidArgumentError, "out has shape"),
    "out_wrong_hidden": (lambda c, t: c.retrieve(t, out=torch.zeros(2, L, 2 * C, D + 1).bfloat16()),
                         lkf.InvalidArgumentError, "out has shape"),
    "out_too_short": (lambda c, t: c.retrieve(t, out=torch.zeros(2, L, 2 * C - 1, D).bfloat16()),
                      lkf.InvalidArgumentError, "out has shape"),
    "out_rank3": (lambda c, t: c.retrieve(t, out=torch.zeros(L, 2 * C, D).bfloat16()),
                  lkf.InvalidArgumentError, "out has shape"),
    "out_noncontiguous": (lambda c, t: c.retrieve(t, out=torch.zeros(2, L, 4 * C, D).bfloat16()[
        :, :, ::2]), lkf.InvalidArgumentError, "out must be contiguous"),
    "out_expanded_overlapping": (lambda c, t: c.retrieve(t, out=torch.zeros(1, L, 2 * C, D)
                                                         .bfloat16().expand(2, -1, -1, -1)),
                                 lkf.InvalidArgumentError, "out must be contiguous"),
    "out_meta": (lambda c, t: c.retrieve(t, out=torch.empty(2, L, 2 * C, D, dtype=torch.bfloat16,
                                                            device="meta")),
                 lkf.InvalidArgumentError, "out must be a CPU tensor"),
    "out_sparse": (lambda c, t: c.retrieve(t, out=torch.zeros(2, L, 2 * C, D).to_sparse()
                                           .to(torch.bfloat16)),
                   lkf.InvalidArgumentError, "out must be a dense"),
    "out_requires_grad": (lambda c, t: c.retrieve(t, out=torch.zeros(2, L, 2 * C, D,
                                                                     dtype=torch.bfloat16,
                                                                     requires_grad=True)),
                          lkf.InvalidArgumentError, "out must not require grad"),
}


def _assert_nothing_half_written(srv: LMCacheServer, ctx: lkf.LMCacheKVCacheContext,
                                 toks: list[int]) -> None:
    assert leftovers(srv) == dict.fromkeys(leftovers(srv), 0)
    assert ctx.lookup(toks) == 0


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_by_name(plane: tuple[LMCacheServer, Model,
                                                   lkf.LMCacheKVCacheContext], case: str) -> None:
    srv, _m, ctx = plane
    call, exc, text = BAD[case]
    toks = rand_tokens(2 * C)
    with pytest.raises(exc) as ei:
        call(ctx, toks)
    assert isinstance(ei.value, lkf.KVCacheSDKError)
    assert text in str(ei.value), str(ei.value)
    _assert_nothing_half_written(srv, ctx, toks)


# ----------------------------------------------------------------------------- accepted
def _roundtrip(ctx: lkf.LMCacheKVCacheContext, kv: torch.Tensor, toks: Any,
               as_list: list[int]) -> None:
    assert ctx.store(kv, toks) is True
    got = ctx.retrieve(as_list)
    assert got is not None
    assert torch.equal(got.view(torch.int16), kv.contiguous().view(torch.int16))


ACCEPTED_KV: dict[str, Callable[[], torch.Tensor]] = {
    "noncontiguous_view": lambda: _kv(4 * C, seed=1)[:, :, ::2],
    "flip": lambda: _kv(2 * C, seed=2).flip(2),
    "expanded_stride0": lambda: _kv(2 * C, seed=3)[:1].expand(2, -1, -1, -1),
    "requires_grad": lambda: _kv(2 * C, seed=4).requires_grad_(True),
    "nan_inf_negzero": lambda: _specials(),
    "all_bit_patterns": lambda: torch.arange(2 * L * 2 * C * D, dtype=torch.int32)
    .remainder(65536).to(torch.int16).view(torch.bfloat16).view(2, L, 2 * C, D),
}


def _specials() -> torch.Tensor:
    kv = _kv(2 * C, seed=5)
    flat = kv.view(-1)
    flat[0::5] = float("nan")
    flat[1::5] = float("inf")
    flat[2::5] = float("-inf")
    flat[3::5] = -0.0
    flat.view(torch.int16)[4::10] = 0x7FC1  # a NaN with payload bits
    return kv


@pytest.mark.parametrize("case", sorted(ACCEPTED_KV))
def test_accepted_kv_is_stored_bit_exact(plane: tuple[LMCacheServer, Model,
                                                      lkf.LMCacheKVCacheContext], case: str) -> None:
    srv, _m, ctx = plane
    toks = rand_tokens(2 * C)
    _roundtrip(ctx, ACCEPTED_KV[case](), toks, toks)
    assert leftovers(srv) == dict.fromkeys(leftovers(srv), 0)


ACCEPTED_TOKENS: dict[str, Callable[[list[int]], Any]] = {
    "tuple": tuple,
    "generator": lambda t: (x for x in t),
    "numpy_int64": lambda t: np.array(t, dtype=np.int64),
    "numpy_uint32": lambda t: np.array(t, dtype=np.uint32),
    "numpy_scalars_list": lambda t: [np.int32(x) for x in t],
    "torch_int64": lambda t: torch.tensor(t, dtype=torch.int64),
    "torch_int32": lambda t: torch.tensor(t, dtype=torch.int32),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_TOKENS))
def test_accepted_token_containers(plane: tuple[LMCacheServer, Model,
                                                lkf.LMCacheKVCacheContext], case: str) -> None:
    _srv, _m, ctx = plane
    toks = rand_tokens(2 * C)
    _roundtrip(ctx, _kv(2 * C, seed=6), ACCEPTED_TOKENS[case](toks), toks)
    assert ctx.lookup(ACCEPTED_TOKENS[case](toks)) == 2 * C


def test_edge_values_accepted(plane: tuple[LMCacheServer, Model,
                                           lkf.LMCacheKVCacheContext]) -> None:
    srv, _m, ctx = plane
    toks = [0, 2**32 - 1] * C  # the whole uint32 range is valid
    _roundtrip(ctx, _kv(2 * C, seed=7), toks, toks)
    rng_toks = range(10**6, 10**6 + 2 * C)
    _roundtrip(ctx, _kv(2 * C, seed=8), rng_toks, list(rng_toks))
    salt = "t" * 128  # the longest salt
    toks2 = rand_tokens(C)
    assert ctx.store(_kv(C, seed=9), toks2, cache_salt=salt)
    assert ctx.lookup(toks2) == 0 and ctx.lookup(toks2, cache_salt=salt) == C
    # empty input: nothing to do, never an error
    assert ctx.store(torch.zeros(2, L, 0, D, dtype=torch.bfloat16), []) is False
    assert ctx.retrieve([]) is None and ctx.lookup([]) == 0
    assert leftovers(srv) == dict.fromkeys(leftovers(srv), 0)


def test_out_may_be_the_stored_tensor(plane: tuple[LMCacheServer, Model,
                                                   lkf.LMCacheKVCacheContext]) -> None:
    """The only aliasing a caller can arrange: retrieve into the tensor it stored."""
    _srv, _m, ctx = plane
    toks, kv = rand_tokens(2 * C), _kv(2 * C, seed=10)
    ref = kv.clone()
    assert ctx.store(kv, toks)
    got = ctx.retrieve(toks, out=kv)
    assert got is not None and got.data_ptr() == kv.data_ptr()
    assert torch.equal(kv.view(torch.int16), ref.view(torch.int16))


# ----------------------------------------------------------------------------- closed / connect
def test_calls_after_close(server_shm: LMCacheServer) -> None:
    m = make_model(server_shm, num_layers=L, num_kv_heads=NH, head_size=HS)
    ctx = lkf.connect(server_shm.url, server_shm.http_url, m.name, timeout=10)
    ctx.close()
    toks = rand_tokens(C)
    calls: list[Callable[[], Any]] = [
        lambda: ctx.store(_kv(C), toks), lambda: ctx.store_ex(_kv(C), toks),
        lambda: ctx.retrieve(toks), lambda: ctx.lookup(toks), ctx.ping,
        lambda: lkf.retrieve(ctx, toks), lambda: lkf.store(ctx, _kv(C), toks),
    ]
    for call in calls:
        with pytest.raises(lkf.ContextClosedError, match="closed"):
            call()
    ctx.close()  # idempotent
    assert leftovers(server_shm) == dict.fromkeys(leftovers(server_shm), 0)


@pytest.mark.parametrize("url, http_url, bad", [
    ("tcp://127.0.0.1", "http://127.0.0.1:1", "url"),
    ("127.0.0.1:5555", "http://127.0.0.1:1", "url"),
    ("http://127.0.0.1:5555", "http://127.0.0.1:1", "url"),
    ("tcp://127.0.0.1:0", "http://127.0.0.1:1", "url"),
    ("tcp://127.0.0.1:65536", "http://127.0.0.1:1", "url"),
    ("tcp://127.0.0.1:99999", "http://127.0.0.1:1", "url"),
    ("tcp://:5555", "http://127.0.0.1:1", "url"),
    ("tcp://a b:5555", "http://127.0.0.1:1", "url"),
    ("ipc://", "http://127.0.0.1:1", "url"),  # ipc://path is accepted (lmcache_kv_fast.sdk)
    ("inproc://x", "http://127.0.0.1:1", "url"),
    ("", "http://127.0.0.1:1", "url"),
    (None, "http://127.0.0.1:1", "url"),
    (5555, "http://127.0.0.1:1", "url"),
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:1", "http_url"),
    ("tcp://127.0.0.1:5555", "127.0.0.1:8080", "http_url"),
    ("tcp://127.0.0.1:5555", "http://127.0.0.1:99999", "http_url"),
    ("tcp://127.0.0.1:5555", "http://127.0.0.1:0", "http_url"),
    ("tcp://127.0.0.1:5555", "http://127.0.0.1:8080/status", "http_url"),
    ("tcp://127.0.0.1:5555", "file:///etc/passwd", "http_url"),
    ("tcp://127.0.0.1:5555", None, "http_url"),
])
def test_connect_malformed_urls(url: Any, http_url: Any, bad: str) -> None:
    with pytest.raises(lkf.InvalidArgumentError) as ei:
        lkf.connect(url, http_url, "m", timeout=5)
    assert str(ei.value).startswith(f"{bad} must look like")
