"""Token and salt validation (before anything is sent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_kv_fast.context import check_salt, normalize_tokens
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError


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
