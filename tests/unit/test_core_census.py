"""The batch's core census (batch/_cores.py) and the native per-thread copy cap it sets.

A real spinning process stands for the engine's busy-poll; the copy cap is checked on
the native core's own pool counter.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time

import pytest
import torch

from lmcache_kv_fast import _native
from lmcache_kv_fast.batch import _cores
from lmcache_kv_fast.batch._cores import CoreCensus, other_running, own_running
from lmcache_kv_fast.copy import native_backend
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

SPIN = "import os, time\nend = time.time() + 30\nwhile time.time() < end:\n    os.sched_yield()\n"


@pytest.fixture
def spinner():
    """Another process that is always runnable (as vLLM's worker after a step)."""
    p = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.3)
        yield p
    finally:
        p.kill()
        p.wait(10)


@pytest.fixture
def two_threads():
    """The copy pool at two threads, parallel from 64 KiB; settings restored after."""
    threads, threshold = _native.get_threads(), _native.get_parallel_threshold()
    _native.set_threads(2)
    _native.set_parallel_threshold(64 << 10)
    try:
        yield
    finally:
        _native.set_call_threads(0)
        _native.set_threads(threads)
        _native.set_parallel_threshold(threshold)


def _pool_jobs_of_copy(nbytes: int = 8 << 20) -> int:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    before = _native.copy_stats()["pool_jobs"]
    _native.memcpy(dst.data_ptr(), src.data_ptr(), nbytes)
    assert torch.equal(dst, src)
    return _native.copy_stats()["pool_jobs"] - before


def test_a_capped_thread_copies_alone_and_the_cap_is_its_own(two_threads):
    assert _pool_jobs_of_copy() == 1
    native_backend.cap_call_threads(1)
    assert _native.get_call_threads() == 1
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(_native.get_call_threads()))
    t.start()
    t.join()
    assert seen == [0]  # another thread keeps the pool
    assert _pool_jobs_of_copy() == 0
    native_backend.cap_call_threads(0)
    assert _pool_jobs_of_copy() == 1


@pytest.mark.parametrize("bad", [-1, _native.MAX_THREADS + 1])
def test_cap_outside_its_range_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="cap must be in"):
        native_backend.cap_call_threads(bad)
    with pytest.raises(ValueError, match="0, 1024"):
        _native.set_call_threads(bad)
    assert _native.get_call_threads() == 0


@pytest.mark.parametrize("bad", [1.0, True, "1"])
def test_cap_of_another_type_is_refused(bad):
    with pytest.raises(InvalidTypeError, match="cap must be an int"):
        native_backend.cap_call_threads(bad)


def _census(samples: list[int], cpus: int = 2) -> tuple[CoreCensus, list[int]]:
    applied: list[int] = []
    it = iter(samples)
    return CoreCensus(applied.append, sample=lambda: next(it), cpus=cpus), applied


def test_no_cap_while_every_core_is_free_in_some_sample():
    census, applied = _census([0, 1, 2])
    census.start()
    assert census.apply() == 0 and applied == [0]


def test_a_task_runnable_in_every_sample_takes_its_core_from_the_copies():
    census, _ = _census([1, 2, 1], cpus=8)
    census.start()
    assert census.cap() == 7
    census, _ = _census([3, 3, 4], cpus=2)  # more than the machine: one thread still
    census.start()
    assert census.cap() == 1


def test_samples_while_running_are_spaced_and_slide(monkeypatch):
    census, applied = _census([1, 1, 1, 0, 5])
    census.start()
    assert census.apply() == 1  # not due yet: the start's samples
    monkeypatch.setattr(_cores, "PERIOD_S", 0.0)
    assert census.apply() == 0  # a sample with every core free
    assert census.apply() == 0  # 5 others now, but not in every sample
    assert applied == [1, 0, 0]


def test_the_census_is_off_without_a_cap_a_view_or_readable_counts(monkeypatch):
    assert not CoreCensus(None).enabled
    assert CoreCensus(None).apply() == 0
    monkeypatch.setenv("LMCACHE_KV_FAST_CORE_CENSUS", "0")
    assert CoreCensus(lambda n: None).cpus == 0
    monkeypatch.delenv("LMCACHE_KV_FAST_CORE_CENSUS")
    monkeypatch.setattr(_cores.os, "cpu_count", lambda: 4096)  # a container's cpuset
    assert CoreCensus(lambda n: None).cpus == 0

    def unreadable() -> int:
        raise OSError("no /proc/loadavg")

    applied: list[int] = []
    census = CoreCensus(applied.append, sample=unreadable, cpus=2)
    census.start()
    assert not census.enabled and census.apply() == 0 and applied == []


def test_another_process_that_never_sleeps_is_counted(spinner):
    assert min(other_running() for _ in range(5)) >= 1
    census = CoreCensus(lambda n: None, cpus=2)
    census.start()
    assert census.cap() == 1


def test_own_running_threads_are_not_counted_as_others():
    stop = threading.Event()
    data = b"\x01" * (4 << 20)

    def hash_loop() -> None:  # hashlib releases the GIL: the thread stays runnable
        while not stop.is_set():
            hashlib.sha256(data).digest()

    t = threading.Thread(target=hash_loop)
    t.start()
    try:
        time.sleep(0.05)
        assert max(own_running() for _ in range(20)) >= 2
    finally:
        stop.set()
        t.join()


def test_threads_applying_at_once_see_whole_caps(monkeypatch):
    """I/O threads apply the cap while one of them samples: every cap they get is one a
    window of samples gives (0 or 1 of 2 CPUs here), and nothing raises."""
    monkeypatch.setattr(_cores, "PERIOD_S", 0.0)
    counter = iter(range(1 << 30))
    census = CoreCensus(lambda n: None, sample=lambda: next(counter) % 2, cpus=2)
    census.start()
    seen: set[int] = set()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(2000):
                seen.add(census.apply())
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and seen <= {0, 1} and census.enabled
