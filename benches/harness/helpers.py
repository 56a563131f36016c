"""Small helpers of the harness: the servers' HTTP plane, L1 pages, memory, tensors.

Standard library only at import (torch is imported where needed): the worker
interpreters import this module too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import urllib.request
from collections.abc import Sequence
from typing import Any

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def http_clear(http_url: str) -> None:
    """``POST /cache/clear`` (L1, forced) without importing this package."""
    req = urllib.request.Request(
        f"{http_url.rstrip('/')}/cache/clear",
        data=json.dumps({"tier": "l1", "force": True}).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


def http_json(http_url: str, path: str) -> Any:
    """GET ``path`` of a server's HTTP plane, as JSON."""
    with urllib.request.urlopen(f"{http_url.rstrip('/')}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def punch_segment(path: str) -> bool:
    """Release every page of the SHM file ``path`` (content becomes zeros); True on success.

    Only call it on a cleared L1: the server's objects live in those pages.
    """
    if not path or not os.path.exists(path):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        rc = libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                            ctypes.c_long(0), ctypes.c_long(size))
        return rc == 0
    finally:
        os.close(fd)


def malloc_trim() -> None:
    """Give glibc's free heap memory back to the system (no-op where unavailable)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def random_kv(shape: Sequence[int]) -> Any:
    """A bf16 tensor of random finite values (cheaper than randn for GiB sizes)."""
    import torch

    t = torch.empty(tuple(shape), dtype=torch.bfloat16)
    t.view(torch.int16).random_(0, 16000)  # positive finite bf16 bit patterns
    return t


def same_bytes(a: Any, b: Any) -> bool:
    """True when the tensors ``a`` and ``b`` have the same shape and bits."""
    import torch

    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
