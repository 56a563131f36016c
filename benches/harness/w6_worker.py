"""W6 worker: one side's prefill → modify → decode on the real engine, in its own process.

``python -m benches.harness.w6_worker -`` (the JSON config on stdin) prints one line
``W6RESULT {json}``. The side is ``ours`` (``lmcache_kv_fast.sdk``) or ``upstream``
(``lmcache.sdk`` 0.5.6, run with what it needs on a CPU engine:
:mod:`testbed.upstream_cpu`). Both use the same engine hook
(``OpenAICompletions``) and the same edit (drop every n-th token), so the prefill and
decode phases are the engine's time and the modify phase is the SDK's.

The modify phase's memory is its peak RSS growth: the process's peak RSS (``VmHWM``,
reset through ``/proc/self/clear_refs`` just before the phase, after a garbage
collection) minus its RSS at that moment, plus the result buffers this SDK made ready
for the modify during the prefill (``sdk/_prepare.py``: the growth of its result pool
over the prefill); a 1 ms sampler of ``VmRSS`` is the fallback where ``clear_refs``
cannot be written.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def status_kib(field: str) -> int:
    """One field of ``/proc/self/status`` in KiB (0 when absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class StatmReader:
    """``RssAnon`` and ``VmRSS`` in KiB from ``/proc/self/statm``, read through one open fd.

    The sampler runs every millisecond inside the phase it measures: a ``statm`` pread
    costs ~2 µs of the process's CPU against ~22 µs to open and parse ``status``.
    ``resident - shared`` is ``RssAnon`` (shared = ``RssFile`` + ``RssShmem``).
    """

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._kib = os.sysconf("SC_PAGE_SIZE") // 1024

    def read(self) -> tuple[int, int]:
        """``(anon, rss)`` now, in KiB."""
        f = os.pread(self._fd, 256, 0).split()
        resident, shared = int(f[1]), int(f[2])
        return (resident - shared) * self._kib, resident * self._kib

    def close(self) -> None:
        os.close(self._fd)


def prepared_bytes() -> int:
    """Idle bytes in this SDK's result pool (0 without the native core).

    Their growth over the prefill is the memory the batched stream made ready for the
    modify then (``sdk/_prepare.py``): counted as the modify's.
    """
    try:
        from lmcache_kv_fast import _native
    except ImportError:
        return 0
    return int(_native.result_pool_stats()["pooled_bytes"])


class PeakRss:
    """Peak RSS growth of a block, in bytes: all of it and its private part.

    ``growth``: peak RSS (``VmHWM``, reset through ``clear_refs``; sampled ``VmRSS`` where
    that cannot be written) minus RSS at the start. It includes the pages of the server's
    SHM pool the process touched (``RssShmem``: the server's memory, mapped by both SDKs,
    not new memory of the machine). ``private``: peak of the private part (``RssAnon``,
    sampled every millisecond from ``statm``) minus its start value. Both include ``extra`` bytes:
    memory allocated for the block before it started (this SDK's result buffers,
    prepared during the prefill).
    """

    def __init__(self, extra: int = 0) -> None:
        self.extra = max(0, int(extra))
        self.growth = 0
        self.private = 0
        self.method = ""
        self._stop = threading.Event()
        self._peak = 0
        self._peak_anon = 0

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.base = self._peak = status_kib("VmRSS")
        self.base_anon = self._peak_anon = status_kib("RssAnon")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampled"
        self._statm = StatmReader()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            anon, rss = self._statm.read()
            self._peak_anon = max(self._peak_anon, anon)
            self._peak = max(self._peak, rss)
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._statm.close()
        self._peak_anon = max(self._peak_anon, status_kib("RssAnon"))
        peak = status_kib("VmHWM") if self.method == "VmHWM" else \
            max(self._peak, status_kib("VmRSS"))
        self.growth = max(0, peak - self.base) * 1024 + self.extra
        self.private = max(0, self._peak_anon - self.base_anon) * 1024 + self.extra


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ...
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


class CpuUse:
    """CPU seconds a block cost this process and the process groups ``pgids`` (by name)."""

    def __init__(self, pgids: dict[str, int]) -> None:
        self.pgids = pgids
        self.seconds: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"self": ru.ru_utime + ru.ru_stime, "self_sys": ru.ru_stime,
                "self_minflt": float(ru.ru_minflt),
                **{name: _group_cpu_s(g) for name, g in self.pgids.items()}}

    def __enter__(self) -> CpuUse:
        self._gc: dict[str, float] = {"gc_collections": 0.0, "gc_full": 0.0, "gc_s": 0.0}
        self._gc_t = 0.0
        gc.callbacks.append(self._on_gc)
        self._t0 = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        t1 = self._now()
        gc.callbacks.remove(self._on_gc)
        self.seconds = {k: t1[k] - self._t0[k] for k in t1} | self._gc

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        """Python's cyclic collections during the block (count, full ones, wall seconds)."""
        if phase == "start":
            self._gc_t = time.perf_counter()
            self._gc["gc_collections"] += 1
            self._gc["gc_full"] += info.get("generation") == 2
        else:
            self._gc["gc_s"] += time.perf_counter() - self._gc_t


def _native_stats() -> dict[str, int]:
    """This SDK's copy-core counters (result pool hits / misses, cold-page writes), flat."""
    try:
        from lmcache_kv_fast import _native
    except ImportError:
        return {}
    out: dict[str, int] = {}
    for prefix, stats in (("pool_", _native.result_pool_stats()), ("copy_", _native.copy_stats())):
        out.update({prefix + k: int(v) for k, v in stats.items() if isinstance(v, (int, float))})
    return out


def drop_every(n: int, kv_kind: Any) -> Callable[..., Any]:
    """The edit: drop every ``n``-th token's K/V and id."""

    def fn(tensors: Any, tokens: list[int]) -> Any:
        kv = tensors[kv_kind]
        keep = [i for i in range(kv.shape[-2]) if i % n != n - 1]
        return kv.index_select(kv.dim() - 2, torch.tensor(keep)), [tokens[i] for i in keep]

    return fn


def landing(ctx: Any, streams: list[Any], salt: str, timeout: float = 60.0,
            interval: float = 0.001) -> dict[str, Any]:
    """When the engine's asynchronous store of every stream became visible after the prefill.

    Looks every stream's expected prefix (its prompt's whole chunks) up, round-robin,
    ``interval`` apart, from the moment the prefill returned. No SDK's modify can end
    before the last stream's KV is on the server (it must read it), so ``land_last_s``
    is a lower bound of any modify phase on this engine, and ``upstream modify /
    land_last_s`` bounds the speed-up any client could show against upstream's.
    """
    t0 = time.perf_counter()
    chunk = ctx.chunk_size
    pending = {i: len(s.tokens) // chunk * chunk for i, s in enumerate(streams)}
    seen: dict[int, float] = {}
    lookups = 0
    while pending and time.perf_counter() - t0 < timeout:
        for i, target in list(pending.items()):
            lookups += 1
            if ctx.lookup(streams[i].tokens[:target], salt) >= target:
                seen[i] = time.perf_counter() - t0
                del pending[i]
        if pending:
            time.sleep(interval)
    times = sorted(seen.values())
    return {"land_first_s": times[0] if times else float("nan"),
            "land_last_s": times[-1] if times and not pending else float("nan"),
            "land_lookups": lookups, "land_missing": len(pending)}


def edit_cpu(ctx: Any, streams: list[Any], salt: str, fn: Callable[..., Any],
             kind: Any) -> float:
    """CPU seconds of the edit alone over every stream's cached KV (read first, untimed).

    Every SDK's modify runs the user's edit once per stream, so this is part of any
    modify's CPU. Each KV is read, then edited twice, each result dropped: once plainly
    (torch's allocator maps a large output afresh, so its pages fault in) and once with
    its outputs in memory that is already mapped (a pool of reused buffers, as this
    SDK's modify runs it; :class:`~lmcache_kv_fast.batch._policy.PooledOutputs`). The
    floor this feeds should favour the hypothetical client, so the cheaper form counts:
    the median stream's CPU of that form times the number of streams (a process's first
    torch calls are not counted).
    """
    from lmcache_kv_fast.batch._policy import PooledOutputs
    from lmcache_kv_fast.copy import backend

    pooled = PooledOutputs(backend().alloc_result) if PooledOutputs is not None else None
    plain: list[float] = []
    mapped: list[float] = []
    for s in streams:
        kv = ctx.retrieve(s.tokens, salt)
        if kv is None:
            continue
        toks = list(s.tokens[: kv.shape[-2]])
        t = time.thread_time()
        fn({kind: kv}, toks)
        plain.append(time.thread_time() - t)
        if pooled is not None:
            with pooled:
                fn({kind: kv}, toks)  # the first use of a pool buffer maps it: untimed
                t = time.thread_time()
                fn({kind: kv}, toks)
                mapped.append(time.thread_time() - t)
    best = [min(a, b) for a, b in zip(plain, mapped, strict=True)] if mapped else plain
    return statistics.median(best) * len(streams) if best else float("nan")


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one side; return its timings, memory and outputs."""
    from lmcache_kv_fast.sdk.hooks import OpenAICompletions

    t0 = time.perf_counter()
    stack = contextlib.ExitStack()
    if cfg["side"] == "upstream":
        import lmcache.sdk as sdk

        from testbed.upstream_cpu import cpu_engine_kv, upstream_on_cpu_engine

        stack.enter_context(upstream_on_cpu_engine(
            cfg["url"], cfg["model"], cpu_engine_kv(cfg["model"], cfg["kernel"])))
        batch_kw: dict[str, Any] = {}
    else:
        import lmcache_kv_fast.sdk as sdk  # type: ignore[no-redef]

        batch_kw = {"progress": False}
        if cfg.get("max_in_flight"):
            batch_kw["max_in_flight"] = int(cfg["max_in_flight"])
    with stack:
        kind = sdk.LMCacheSDKCacheKind.KV
        ctx = sdk.connect(kind, cfg["url"], cfg["http_url"], cfg["model"])
        import_connect_s = time.perf_counter() - t0
        try:
            hook = OpenAICompletions(cfg["vllm_url"], cfg["model"])
            batch = sdk.batch.LMCacheBatchedStream(**batch_kw)
            streams = [sdk.request.create_request([ctx], hook, p, cache_salt=cfg["salt"])
                       for p in cfg["prompts"]]
            for s in streams:
                batch.add(s)
            sp = {"temperature": 0.0, "ignore_eos": True}
            pool0 = prepared_bytes()
            t = time.perf_counter()
            batch.prefill(sp)
            prefill_s = time.perf_counter() - t
            prepared = max(0, prepared_bytes() - pool0)
            fn = drop_every(int(cfg["drop_every"]), kind)
            if cfg["side"] == "ours" and cfg.get("edit", "library") == "library":
                from lmcache_kv_fast import edits

                fn = edits.drop_every(int(cfg["drop_every"]))  # the same tokens dropped
            if cfg["side"] == "land":
                landed = landing(ctx, streams, cfg["salt"])
                return {"side": "land", "streams": len(streams),
                        "import_connect_s": import_connect_s, "prefill_s": prefill_s,
                        **landed, "edit_cpu_s": edit_cpu(ctx, streams, cfg["salt"], fn, kind)}
            time.sleep(float(cfg.get("settle_s") or 0.0))
            native0 = _native_stats() if cfg["side"] == "ours" else {}
            with PeakRss(prepared) as rss, CpuUse(dict(cfg.get("pgids") or {})) as cpu:
                t = time.perf_counter()
                report = batch.modify(fn)
                modify_s = time.perf_counter() - t
            native1 = _native_stats() if cfg["side"] == "ours" else {}
            t = time.perf_counter()
            batch.decode({**sp, "max_tokens": int(cfg["max_tokens"])})
            decode_s = time.perf_counter() - t
            return {
                "side": cfg["side"], "streams": len(streams),
                "prompt_tokens": sum(len(p) for p in cfg["prompts"]),
                "import_connect_s": import_connect_s, "prefill_s": prefill_s,
                "modify_s": modify_s, "decode_s": decode_s,
                "modify_rss_growth": rss.growth, "modify_private_growth": rss.private,
                "rss_method": rss.method, "modify_cpu_s": cpu.seconds,
                "modify_prepared_bytes": prepared,
                "native_stats": {k: native1[k] - native0.get(k, 0) for k in native1},
                "tokens": [list(s.tokens) for s in streams],
                "modify_report": report.to_dict(),
                "fused_streams": _fused_streams(batch),
            }
        finally:
            ctx.close()


def _fused_streams(batch: Any) -> int | None:
    """How many streams this SDK's modify rewrote slot to slot (None: upstream's)."""
    out = getattr(batch, "last_modify", None)
    if out is None:
        return None
    return sum(getattr(m, "path", "") == "fused" for m in out.items)


def main() -> None:
    """Run the side configured on stdin (``-``) or in ``argv[1]`` (JSON); print its result."""
    cfg = json.loads(sys.stdin.read() if sys.argv[1] == "-" else sys.argv[1])
    torch.set_num_threads(int(cfg.get("torch_threads") or torch.get_num_threads()))
    res = run(cfg)
    sys.stdout.write("W6RESULT " + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
