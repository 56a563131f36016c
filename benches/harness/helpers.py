"""Small helpers of the harness: the servers' HTTP plane, L1 pages, memory, tensors.

Standard library only at import (torch is imported where needed): the worker
interpreters import this module too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
import time
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


def private_memory() -> dict[str, int]:
    """This process's private and anonymous bytes (``/proc/self/smaps_rollup``).

    ``private``: Private_Clean + Private_Dirty (pages only this process maps: its heap, and
    any page of a shared mapping no other process has mapped); ``anon``: Anonymous. Zeros
    where the file is missing (not Linux).
    """
    kb = {"Private_Clean": 0, "Private_Dirty": 0, "Anonymous": 0}
    with contextlib.suppress(OSError), open("/proc/self/smaps_rollup", "rb") as fh:
        for line in fh.read().decode().splitlines():
            key, _, rest = line.partition(":")
            if key in kb:
                kb[key] = int(rest.split()[0])
    return {"private": 1024 * (kb["Private_Clean"] + kb["Private_Dirty"]),
            "anon": 1024 * kb["Anonymous"]}


def rss_anon() -> int:
    """This process's resident anonymous bytes (``/proc/self/statm``: resident - shared).

    A counter read, microseconds where :func:`private_memory` walks every page table.
    """
    with contextlib.suppress(OSError, ValueError, IndexError), \
            open("/proc/self/statm", "rb") as fh:
        fields = fh.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    return 0


class PrivatePeak:
    """The peak growth of this process's memory while a ``with`` block runs.

    One daemon thread reads :func:`private_memory` every ``interval`` seconds (a read walks
    every mapping's page tables: with GiBs mapped it takes tens of ms, so the real spacing
    is ``read_s / samples`` + ``interval``); another reads :func:`rss_anon` every
    ``fast_interval``. Both sample once more at the end; baselines are taken on entry.
    ``growth`` (Private_Clean + Private_Dirty), ``anon_growth`` (Anonymous) and
    ``rss_anon_growth``: peak minus baseline, bytes.
    """

    def __init__(self, interval: float = 0.005, fast_interval: float = 0.001) -> None:
        self.interval, self.fast_interval = interval, fast_interval
        self.base: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.samples = 0
        self.read_s = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _sample(self) -> None:
        t0 = time.perf_counter()
        now = private_memory()
        self.read_s += time.perf_counter() - t0
        self.samples += 1
        self._keep(now)

    def _keep(self, now: dict[str, int]) -> None:
        for k, v in now.items():
            self.peak[k] = max(self.peak.get(k, v), v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _run_fast(self) -> None:
        while not self._stop.wait(self.fast_interval):
            self._keep({"rss_anon": rss_anon()})

    def __enter__(self) -> PrivatePeak:
        self.base = {**private_memory(), "rss_anon": rss_anon()}
        self.peak = dict(self.base)
        self._threads = [threading.Thread(target=f, name=f"private-peak-{i}", daemon=True)
                         for i, f in enumerate((self._run, self._run_fast))]
        for th in self._threads:
            th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for th in self._threads:
            th.join()
        self._sample()
        self._keep({"rss_anon": rss_anon()})

    def _growth(self, key: str) -> int:
        return self.peak.get(key, 0) - self.base.get(key, 0)

    @property
    def growth(self) -> int:
        """Peak Private_Clean + Private_Dirty minus the baseline (bytes)."""
        return self._growth("private")

    @property
    def anon_growth(self) -> int:
        """Peak Anonymous (``smaps_rollup``) minus the baseline (bytes)."""
        return self._growth("anon")

    @property
    def rss_anon_growth(self) -> int:
        """Peak resident anonymous bytes (``statm``, every ``fast_interval``) minus the baseline."""
        return self._growth("rss_anon")
