"""W3 with the edit users write: ``batch.rewrite`` vs plain loops, paired, in one process.

Not part of CI. Starts a real SHM server, then rep by rep alternates (rotating the order):

* ``rewrite``: ``batch.rewrite(ctx, prompts, drop_every_10th)`` with the plain edit
  (``kv.index_select(2, torch.tensor(keep))``: fresh output memory every call);
* ``loop``: this SDK's plain loop ``retrieve -> fn -> store``;
* ``loop-t1``: the same loop with ``torch.set_num_threads(1)`` (an edit on both cores of a
  loaded 2-core box spends most of its time in OpenMP spin-waits);
* ``upstream``: the same loop over ``lmcache.sdk.kvcache`` 0.5.6, in a worker process (it
  never imports this package) driven rep by rep;
* ``rewrite-alloc``: ``batch.rewrite`` with an edit that writes into ``alloc``;
* ``fn`` (not by default): the same N calls of the plain edit alone (on the source
  tensor, main thread), for reference;
* ``rewrite-before`` (with ``--before-batch FILE``): ``rewrite`` of another version of
  ``batch.py`` (e.g. ``git show <commit>:lmcache_kv_fast/batch/_api.py > /tmp/b.py``), paired;
  ``rewrite-before-alloc`` the same with the ``alloc`` edit (add it to ``--paths``);
* ``rewrite:NAME`` (with ``--variant NAME:key=value,...``): ``rewrite`` with other keyword
  arguments (JSON values), e.g. ``--variant et2:edit_threads=2`` (``edit=alloc``: the
  ``alloc`` edit).

Before every path the L1 is cleared and the N sequences are seeded again (not timed). In
the warm-up rep every path's N stored edits are read back and compared bit for bit with
the edit of their source (each sequence's source differs). Prints per path the median and
range of the wall time, the summed stage times (retrieve / fn / store), minor page faults,
CPU seconds and peak private-RSS growth, and the paired speed-ups per rep:

    .venv/bin/python benches/bench_batch_plain.py                  # 16 x 2048 tok, 32 layers
    taskset -c 0 .venv/bin/python benches/bench_batch_plain.py --quick
    .venv/bin/python benches/bench_batch_plain.py --rewrite-kw pool_outputs=false

Everything it starts runs on the CPUs this process may use (``taskset`` applies to the
server and the upstream worker too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the checkout root, for benches.harness
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benches.harness.edits import plain_loop as edit_loop

ALL_PATHS = ("rewrite", "loop", "loop-t1", "upstream", "rewrite-alloc", "fn", "rewrite-before",
             "rewrite-before-alloc")
DEFAULT_PATHS = ("rewrite", "loop", "loop-t1", "upstream", "rewrite-alloc")
MARK_TOKENS = 4  # tokens 0..3 of every layer carry the sequence's mark (all kept)


# ------------------------------------------------------------------------------ edits
def drop_every_10th(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """The plain edit (the issue's / README's first form): fresh output every call."""
    keep = [i for i in range(len(tokens)) if i % 10 != 9]
    return kv.index_select(2, torch.tensor(keep)), [tokens[i] for i in keep]


def drop_every_10th_alloc(kv: torch.Tensor, tokens: Sequence[int], *,
                          alloc: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The same edit written into ``rewrite``'s ``alloc``."""
    keep = [i for i in range(len(tokens)) if i % 10 != 9]
    out = alloc((*kv.shape[:-2], len(keep), kv.shape[-1]), kv.dtype)
    torch.index_select(kv, 2, torch.tensor(keep), out=out)
    return out, [tokens[i] for i in keep]


# ------------------------------------------------------------------------------ probes
def rss_anon() -> int:
    """Private resident bytes of this process (``RssAnon``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Probe:
    """Wall, CPU, minor faults, context switches and peak RssAnon growth of a block."""

    def __init__(self, period: float = 0.005) -> None:
        self._period = period
        self._stop = threading.Event()
        self.out: dict[str, float] = {}

    def _sample(self) -> None:
        while not self._stop.wait(self._period):
            self._peak = max(self._peak, rss_anon())

    def __enter__(self) -> Probe:
        self._rss0 = self._peak = rss_anon()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        self._w0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._w0
        self._stop.set()
        self._t.join()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self._peak = max(self._peak, rss_anon())
        self.out = {
            "seconds": wall,
            "cpu": ru.ru_utime + ru.ru_stime - self._ru0.ru_utime - self._ru0.ru_stime,
            "sys": ru.ru_stime - self._ru0.ru_stime,
            "minflt": ru.ru_minflt - self._ru0.ru_minflt,
            "ivcsw": ru.ru_nivcsw - self._ru0.ru_nivcsw,
            "rss_growth": self._peak - self._rss0,
        }


def plain_loop(ctx: Any, prompts: Sequence[Sequence[int]],
               fn: Callable[..., tuple[torch.Tensor, list[int]]]) -> tuple[int, dict[str, float]]:
    """``retrieve -> fn -> store`` per prompt (works for both SDKs); (stored, stage times)."""
    stages = {"retrieve": 0.0, "fn": 0.0, "store": 0.0}
    return edit_loop(ctx, prompts, fn, stages), stages


# ------------------------------------------------------------------------------ upstream
def upstream_worker(spec_path: str) -> int:
    """Worker process: connect with ``lmcache.sdk.kvcache``, run the loop per command."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        import lmcache.sdk.kvcache as up
    except Exception as err:  # reported to the driver
        print("@@skip " + json.dumps(repr(err)), flush=True)
        return 0
    ctx = up.connect(spec["url"], spec["http_url"], spec["model"], timeout=120)
    prompts = spec["prompts"]
    print("@@ready", flush=True)
    try:
        for line in sys.stdin:
            if json.loads(line)["cmd"] != "run":
                break
            gc.collect()
            with Probe() as p:
                ok, stages = plain_loop(ctx, prompts, drop_every_10th)
            print("@@res " + json.dumps({**p.out, "ok": ok, "stages": stages}), flush=True)
    finally:
        ctx.close()
    return 0


class Upstream:
    """Drives :func:`upstream_worker` in a child interpreter."""

    def __init__(self, url: str, http_url: str, model: str, prompts: list[list[int]]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bench-plain-")
        spec = Path(self._dir.name) / "spec.json"
        spec.write_text(json.dumps({"url": url, "http_url": http_url, "model": model,
                                    "prompts": prompts}))
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
               "PYTHONUNBUFFERED": "1", "LMCACHE_DISABLE_BANNER": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--upstream-worker", str(spec)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.skip = ""
        line = self._line()
        if line.startswith("@@skip"):
            self.skip = line
        elif not line.startswith("@@ready"):
            raise RuntimeError(f"upstream worker did not start: {line!r}")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("upstream worker exited")
            if line.startswith("@@"):
                return line.strip()

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "run"}) + "\n")
        self.proc.stdin.flush()
        line = self._line()
        if not line.startswith("@@res "):
            raise RuntimeError(f"upstream worker: {line!r}")
        return json.loads(line[6:])

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


# ------------------------------------------------------------------------------ driver
def marked(base: torch.Tensor, saved: torch.Tensor, i: int) -> torch.Tensor:
    """``base`` with sequence ``i``'s mark in tokens 0..3 (in place; returns base)."""
    base[:, :, :MARK_TOKENS, :].copy_(saved)
    base[:, :, :MARK_TOKENS, :16].view(torch.int16).add_(i + 1).clamp_(0, 16000)
    return base


def parse_kw(items: Sequence[str]) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (JSON values, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        k, _, v = item.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def fmt_range(xs: Sequence[float], spec: str = ".2f") -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:{spec}} [{min(xs):{spec}}-{max(xs):{spec}}]"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="timed reps (after one warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed reps (verified)")
    ap.add_argument("--quick", action="store_true", help="8 x 1024 tokens, 8 layers, 2 reps")
    ap.add_argument("--l1-gb", type=float, default=12.0)
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS))
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:key=value,... adds path rewrite:NAME (repeatable)")
    ap.add_argument("--rewrite-kw", action="append", default=[],
                    help="extra batch.rewrite keyword, e.g. workers=2 (repeatable; JSON values)")
    ap.add_argument("--json", help="write every record here")
    ap.add_argument("--before-batch", help="a batch.py to time as path rewrite-before")
    ap.add_argument("--upstream-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.upstream_worker:
        return upstream_worker(args.upstream_worker)
    if args.quick:
        args.sequences, args.tokens, args.layers, args.reps = 8, 1024, 8, 2
    paths = [p for p in args.paths.split(",") if p]
    if args.before_batch and "rewrite-before" not in paths:
        paths.append("rewrite-before")
    if not args.before_batch:
        paths = [p for p in paths if not p.startswith("rewrite-before")]
    bad = [p for p in paths if p not in ALL_PATHS]
    if bad:
        ap.error(f"unknown paths {bad}; choose from {ALL_PATHS}")
    rw_kw = parse_kw(args.rewrite_kw)
    variants: dict[str, dict[str, Any]] = {}
    for v in args.variant:
        name, _, kws = v.partition(":")
        variants[f"rewrite:{name}"] = {**rw_kw, **parse_kw(kws.split(",") if kws else [])}
        paths.append(f"rewrite:{name}")

    from lmcache_kv_fast import batch, kvcache
    from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout

    before: Any = None
    if args.before_batch:
        import importlib.util

        spec = importlib.util.spec_from_file_location("batch_before", args.before_batch)
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        sys.modules["batch_before"] = before
        spec.loader.exec_module(before)

    kv_bytes = 2 * args.layers * args.tokens * 1024 * 2
    cores = len(os.sched_getaffinity(0))
    print(f"{args.sequences} sequences x [2, {args.layers}, {args.tokens}, 1024] bf16 "
          f"({kv_bytes / 2**20:.0f} MiB each); {cores} usable cores; torch threads "
          f"{torch.get_num_threads()}; paths {paths}; reps {args.reps} (+{args.warmup} warm-up); "
          f"rewrite kw {rw_kw}", flush=True)
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 100_000) for _ in range(args.tokens)]
               for _ in range(args.sequences)]
    base = torch.empty((2, args.layers, args.tokens, 1024), dtype=torch.bfloat16)
    base.view(torch.int16).random_(0, 16000, generator=torch.Generator().manual_seed(1))
    saved = base[:, :, :MARK_TOKENS, :].clone()
    records: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    up: Upstream | None = None
    with LMCacheServer(shm=True, l1_size_gb=args.l1_gb) as srv:
        register_vllm_layout(srv.url, "plain", num_layers=args.layers, num_kv_heads=8,
                             head_size=128)
        with kvcache.connect(srv.url, srv.http_url, "plain", timeout=120) as ctx:
            try:
                if "upstream" in paths:
                    up = Upstream(srv.url, srv.http_url, "plain", prompts)
                    if up.skip:
                        print(f"upstream skipped: {up.skip}", flush=True)
                        paths.remove("upstream")

                def seed() -> None:
                    ctx.clear(force=True)
                    for i, p in enumerate(prompts):
                        if not ctx.store(marked(base, saved, i), p):
                            raise RuntimeError(f"seeding sequence {i} failed (L1 too small?)")

                def verify(path: str) -> None:
                    for i, p in enumerate(prompts):
                        want, new_toks = drop_every_10th(marked(base, saved, i), p)
                        got = ctx.retrieve(new_toks)
                        n = len(new_toks) // ctx.chunk_size * ctx.chunk_size
                        if got is None or got.shape[-2] != n or not torch.equal(
                                got.view(torch.int16), want[:, :, :n].view(torch.int16)):
                            raise RuntimeError(f"{path}: sequence {i} read back wrong")
                        del want, got

                def run(path: str) -> dict[str, Any]:
                    if path == "upstream":
                        assert up is not None
                        return up.run()
                    gc.collect()
                    with Probe() as pr:
                        if path == "loop":
                            ok, stages = plain_loop(ctx, prompts, drop_every_10th)
                        elif path == "loop-t1":
                            nt = torch.get_num_threads()
                            torch.set_num_threads(1)
                            try:
                                ok, stages = plain_loop(ctx, prompts, drop_every_10th)
                            finally:
                                torch.set_num_threads(nt)
                        elif path == "fn":
                            stages = {}
                            for p in prompts:
                                out, _ = drop_every_10th(base, p)
                                del out
                            ok = len(prompts)
                        elif path in variants:
                            kw = dict(variants[path])
                            fn = drop_every_10th_alloc if kw.pop("edit", "") == "alloc" else \
                                drop_every_10th
                            rep = batch.rewrite(ctx, prompts, fn, progress=False, **kw)
                            ok, stages = rep.ok, dict(rep.stage_seconds)
                        elif path.startswith("rewrite-before"):
                            fn = drop_every_10th_alloc if path.endswith("alloc") else \
                                drop_every_10th
                            rep = before.rewrite(ctx, prompts, fn, progress=False)
                            ok, stages = rep.ok, dict(rep.stage_seconds)
                        else:
                            fn = drop_every_10th_alloc if path == "rewrite-alloc" else \
                                drop_every_10th
                            rep = batch.rewrite(ctx, prompts, fn, progress=False, **rw_kw)
                            ok, stages = rep.ok, dict(rep.stage_seconds)
                    return {**pr.out, "ok": ok, "stages": stages}

                for r in range(args.warmup + args.reps):
                    order = paths[r % len(paths):] + paths[:r % len(paths)]
                    line = []
                    for path in order:
                        if path != "fn":
                            seed()
                        res = run(path)
                        if res["ok"] != args.sequences:
                            raise RuntimeError(f"{path}: {res['ok']}/{args.sequences} rewritten")
                        if r < max(1, args.warmup) and path != "fn":
                            verify(path)
                        line.append(f"{path} {res['seconds']:.2f}s")
                        if r >= args.warmup:
                            records[path].append(res)
                    print(f"rep {r}{' (warm-up, verified)' if r < args.warmup else ''}: "
                          + ", ".join(line), flush=True)
            finally:
                if up is not None:
                    up.close()
                ctx.clear(force=True)
    report(records, kv_bytes)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cores": cores,
                                               "records": records}, indent=1))
    return 0


def report(records: dict[str, list[dict[str, Any]]], kv_bytes: int) -> None:
    """Print per-path medians [ranges] and the paired speed-ups."""
    print(f"\n{'path':16} {'seconds':>20} {'retrieve':>8} {'fn':>8} {'store':>8} "
          f"{'minflt':>9} {'cpu s':>6} {'RSS+ MiB':>9} {'xKV':>5}")
    for path, recs in records.items():
        if not recs:
            continue
        st = {k: statistics.median(r["stages"].get(k, 0.0) for r in recs)
              for k in ("retrieve", "fn", "store")}
        med = {k: statistics.median(r[k] for r in recs) for k in ("minflt", "cpu", "rss_growth")}
        print(f"{path:16} {fmt_range([r['seconds'] for r in recs]):>20} {st['retrieve']:8.2f} "
              f"{st['fn']:8.2f} {st['store']:8.2f} {med['minflt']:9.0f} {med['cpu']:6.1f} "
              f"{med['rss_growth'] / 2**20:9.0f} {med['rss_growth'] / kv_bytes:5.2f}")
    pairs = [("loop", "rewrite"), ("loop-t1", "rewrite"), ("upstream", "rewrite"),
             ("loop", "rewrite-alloc"), ("upstream", "rewrite-alloc"), ("upstream", "loop"),
             ("rewrite-before", "rewrite"), ("loop", "rewrite-before"),
             ("loop-t1", "rewrite-before"), ("rewrite-before-alloc", "rewrite-alloc")]
    pairs += [("rewrite", p) for p in records if p.startswith("rewrite:")]
    print("\npaired speed-ups (time of A / time of B, per rep): median [range]")
    for a, b in pairs:
        ra, rb = records.get(a, []), records.get(b, [])
        xs = [x["seconds"] / y["seconds"] for x, y in zip(ra, rb, strict=False)]
        if xs:
            print(f"  {b} vs {a}: {fmt_range(xs)}x  ({', '.join(f'{x:.2f}' for x in xs)})")


if __name__ == "__main__":
    raise SystemExit(main())
