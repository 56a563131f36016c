"""How many threads a batched rewrite's copies may split over: the cores nobody else holds.

A batch keeps items in flight side by side, and each item's copy may also be split over
the copy pool. That pays on an idle machine, but a core another process keeps busy
costs it: a vLLM CPU worker busy-polls a core for 1 s after each step, and a pool thread
placed on that core waits there while the item's own thread waits for it
(docs/performance.md, "The engine's busy-poll and the copy pool"). So the batch's I/O
threads cap their copies at the cores that are free: the CPUs this process may use
minus the tasks of other processes found runnable in each of the last few samples
(``/proc/loadavg``'s running count minus this process's running threads). Nobody else
busy: no cap, as before.

The census is off (no cap) where it cannot see the machine this process runs on: no
``/proc/loadavg``, an affinity mask narrower than the machine (a container's cpuset:
the host's tasks are counted there), a backend without the cap, or
``LMCACHE_KV_FAST_CORE_CENSUS=0``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("lmcache_kv_fast.batch")

__all__ = ["CoreCensus", "other_running", "own_running"]

#: Samples whose minimum is taken: a task of another process counts only when it was
#: runnable in each of them (a busy-poll is; a server answering a request mostly not).
WINDOW = 3
#: Seconds between two samples while the batch runs.
PERIOD_S = 0.1


def own_running() -> int:
    """This process's threads that are running or runnable now (state ``R``)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(b")")
        n += stat[end + 2:end + 3] == b"R"
    return n


def other_running() -> int:
    """Tasks of other processes running or runnable now, on the whole machine."""
    with open("/proc/loadavg", "rb") as f:
        running = int(f.read().split()[3].split(b"/")[0])
    return 0 if running <= 1 else max(0, running - own_running())  # 1: the caller


def _usable_cpus() -> int:
    """CPUs this process may run on, or 0 when the census cannot see them."""
    if os.environ.get("LMCACHE_KV_FAST_CORE_CENSUS", "1") == "0":
        return 0
    try:
        usable = len(os.sched_getaffinity(0))
        ok = os.path.exists("/proc/loadavg") and usable == os.cpu_count()
    except (AttributeError, OSError):
        return 0
    return usable if ok else 0


class CoreCensus:
    """The free cores, sampled while a batch runs, applied as each I/O thread's copy cap.

    Args:
        apply: ``apply(n)`` caps the calling thread's copies at ``n`` threads (0: none);
            None disables the census.
        sample: Counts the other processes' runnable tasks (:func:`other_running`).
        cpus: Usable CPUs (default: this process's, 0 where the census cannot see them).
    """

    def __init__(self, apply: Callable[[int], None] | None,
                 sample: Callable[[], int] = other_running, cpus: int | None = None) -> None:
        self._apply = apply
        self._sample = sample
        self.cpus = _usable_cpus() if cpus is None else cpus
        self._seen: collections.deque[int] = collections.deque(maxlen=WINDOW)
        self._cap = 0  # from the samples, under the lock; read by any thread
        self._at = 0.0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._apply is not None and self.cpus > 0

    def start(self) -> None:
        """Take a batch's first samples (its threads are not running yet)."""
        if not self.enabled:
            return
        with self._lock:
            self._seen.clear()
            self._cap = 0
            for _ in range(WINDOW):
                self._take()

    def cap(self) -> int:
        """The copy cap now: 0 when no other process holds a core, else the free cores."""
        return self._cap if self.enabled else 0

    def apply(self) -> int:
        """Sample if due, then cap the calling thread's copies; return the cap."""
        apply = self._apply  # another thread may turn the census off meanwhile
        if apply is None or self.cpus <= 0:
            return 0
        if time.monotonic() - self._at >= PERIOD_S and self._lock.acquire(blocking=False):
            try:
                self._take()
            finally:
                self._lock.release()
        n = self.cap()
        apply(n)
        return n

    def _take(self) -> None:
        """One sample, and the cap from the window (the caller holds the lock)."""
        try:
            self._seen.append(self._sample())
        except (OSError, ValueError, IndexError) as err:
            logger.debug("core census off: %r", err)
            self._apply = None
        busy = min(self._seen, default=0)
        self._cap = 0 if busy == 0 else max(1, self.cpus - busy)
        self._at = time.monotonic()
