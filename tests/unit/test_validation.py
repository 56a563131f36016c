"""Token and salt validation (before anything is sent)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError
from lmcache_kv_fast.validation import check_connect_args, check_request_configs, check_salt, normalize_tokens


@pytest.mark.parametrize("tokens, want", [
    ([1, 2, 3], [1, 2, 3]),
    ((1, 2), [1, 2]),
    (range(3), [0, 1, 2]),
    (np.array([5, 6], dtype=np.int64), [5, 6]),
    (np.array([5, 6], dtype=np.uint32), [5, 6]),
    (torch.tensor([7, 8]), [7, 8]),
    ([np.int64(3), 4], [3, 4]),
    ([2**32 - 1], [2**32 - 1]),
    ([], []),
])
def test_accepted_tokens(tokens, want):
    assert normalize_tokens(tokens) == want


@pytest.mark.parametrize("tokens, exc", [
    ([1, -1], InvalidArgumentError),
    ([2**32], InvalidArgumentError),
    ([1.0, 2.0], InvalidTypeError),
    ([True, 1], InvalidTypeError),
    ("abc", InvalidTypeError),
    (None, InvalidTypeError),
    (5, InvalidTypeError),
    (torch.tensor([1.0]), InvalidTypeError),
    (np.zeros((2, 2), dtype=np.int64), InvalidArgumentError),
    (["1"], InvalidTypeError),
])
def test_refused_tokens(tokens, exc):
    with pytest.raises(exc, match="tokens"):
        normalize_tokens(tokens)


@pytest.mark.parametrize("salt", ["", "tenant-1", "x" * 128, "ünïcode"])
def test_good_salts(salt):
    assert check_salt(salt) == salt


@pytest.mark.parametrize("salt, exc", [("a@b", InvalidArgumentError), ("a/b", InvalidArgumentError),
                                       ("a\\b", InvalidArgumentError), ("a\x00", InvalidArgumentError),
                                       ("x" * 129, InvalidArgumentError), (None, InvalidTypeError),
                                       (b"s", InvalidTypeError)])
def test_bad_salts(salt, exc):
    with pytest.raises(exc, match="cache_salt"):
        check_salt(salt)


# ----------------------------------------------------------------------------- issue 19
class _Str(str):
    pass


def _quantized(dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated (still exist)
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.arange(4, dtype=torch.float32), 1.0, 0, dtype)


@pytest.mark.parametrize("tokens, exc, text", [
    (_quantized(torch.quint8), InvalidTypeError, "integer dtype"),
    (_quantized(torch.qint8), InvalidTypeError, "integer dtype"),
    (_quantized(torch.qint32), InvalidTypeError, "integer dtype"),
    (torch.empty(4, dtype=torch.int64, device="meta"), InvalidTypeError, "meta device"),
    ([np.bool_(True), np.bool_(False)], InvalidTypeError, "only ints"),
    ([1, np.bool_(True)], InvalidTypeError, "only ints"),
    ((np.bool_(True),), InvalidTypeError, "only ints"),
    ([torch.tensor(True)], InvalidTypeError, "only ints"),
    ([torch.tensor(1.5)], InvalidTypeError, "only ints"),
    (np.array([True, False]), InvalidTypeError, "integer dtype"),
    (torch.tensor([1.0]).to_sparse(), InvalidTypeError, "tokens"),
])
def test_refused_token_containers(tokens, exc, text):
    with pytest.raises(exc, match=text):
        normalize_tokens(tokens)


def test_integer_scalars_still_accepted():
    assert normalize_tokens([np.uint32(5), torch.tensor(6), np.int8(7)]) == [5, 6, 7]
    assert normalize_tokens(torch.tensor([1, 2], dtype=torch.uint8)) == [1, 2]


@pytest.mark.parametrize("salt, exc, text", [
    ("a\ud800", InvalidArgumentError, "valid Unicode"),
    ("\udfff", InvalidArgumentError, "lone surrogate"),
    (_Str("x"), InvalidTypeError, "subclass of str"),
])
def test_unencodable_salts(salt, exc, text):
    with pytest.raises(exc, match=text):
        check_salt(salt)


def _deep(n):
    d = {}
    for _ in range(n):
        d = {"a": d}
    return d


@pytest.mark.parametrize("rc, exc, text", [
    (_deep(10_000), InvalidArgumentError, "nested too deeply"),
    ({"a": _deep(200)}, None, ""),  # moderately deep: fine
    ({"k": "a\ud800"}, InvalidArgumentError, "lone surrogate"),
    ({"k": _Str("v")}, InvalidTypeError, "cannot be encoded"),
    ({"k": object()}, InvalidTypeError, "cannot be encoded"),
])
def test_request_configs_checked(rc, exc, text):
    if exc is None:
        assert check_request_configs(rc) is rc
        return
    with pytest.raises(exc, match=text):
        check_request_configs(rc)


_OK = dict(url="tcp://127.0.0.1:5555", http_url="http://127.0.0.1:8080", model_name="m",
           timeout=5.0, world_size=None, copy_threads=None)


@pytest.mark.parametrize("kw", [
    dict(url="tcp://[::1]:5555"),
    dict(url="tcp://lmcache-server.internal:5555"),
    dict(url="tcp://host_with_underscore:1"),
    dict(url="tcp://10.0.0.1:65535"),
    dict(http_url="http://[::1]:8080/"),
    dict(http_url="https://example.com"),
    dict(http_url="http://localhost"),
    dict(copy_threads=1), dict(copy_threads=1024),
    dict(model_name="ünïcode-model"),
])
def test_connect_args_accepted(kw):
    check_connect_args(**{**_OK, **kw})


@pytest.mark.parametrize("kw, exc, text", [
    (dict(url="tcp://127.0.0.1:5555\n"), InvalidArgumentError, "ends with a newline"),
    (dict(url="tcp://127.0.0.1:5555\r"), InvalidArgumentError, "ends with a newline"),
    (dict(url="tcp://*:5555"), InvalidArgumentError, "wildcard"),
    (dict(url="tcp://hôst:5555"), InvalidArgumentError, "ASCII"),
    (dict(url="tcp://127.0.0.1:５５５５"), InvalidArgumentError, "ASCII"),
    (dict(url="tcp://::1:5555"), InvalidArgumentError, "brackets"),
    (dict(url="tcp://[::1]"), InvalidArgumentError, "port is missing"),
    (dict(url="tcp://[::1:5555"), InvalidArgumentError, "closing"),
    (dict(url="tcp://-bad-.host:5555"), InvalidArgumentError, "host name"),
    (dict(url="tcp://a..b:5555"), InvalidArgumentError, "host name"),
    (dict(url="tcp://h:+555"), InvalidArgumentError, "port"),
    (dict(url="tcp://h:05555x"), InvalidArgumentError, "port"),
    (dict(url="inproc://x"), InvalidArgumentError, "scheme"),
    (dict(url="ipc://"), InvalidArgumentError, "ipc:// path is empty"),
    (dict(url="tcp://h:1/"), InvalidArgumentError, "no path"),
    (dict(http_url="http://h:1\n"), InvalidArgumentError, "ends with a newline"),
    (dict(http_url="http://*:1"), InvalidArgumentError, "wildcard"),
    (dict(http_url="http://h:1/x"), InvalidArgumentError, "no path"),
    (dict(http_url="http://user@h:1"), InvalidArgumentError, "host name"),
    (dict(model_name="m\ud800"), InvalidArgumentError, "model_name must be valid Unicode"),
    (dict(model_name=_Str("m")), InvalidTypeError, "model_name must be a str"),
    (dict(model_name=None), InvalidTypeError, "model_name must be a str"),
    (dict(copy_threads=100_000), InvalidArgumentError, r"copy_threads must be an int in \[1, 1024\]"),
    (dict(copy_threads=0), InvalidArgumentError, "copy_threads"),
    (dict(copy_threads=True), InvalidArgumentError, "copy_threads"),
])
def test_connect_args_refused(kw, exc, text):
    with pytest.raises(exc, match=text):
        check_connect_args(**{**_OK, **kw})
