"""W5, the engine loop (``lmcache-kv-fast bench --engine``).

A real vLLM CPU engine (``testbed.engine.OfflineEngine``, tiny random
Llama) and a real LMCache server; per path and rep, ``N`` fresh prompts go through:

1. **prefill** — the engine computes them; its connector stores their KV in LMCache;
2. **retrieve** — the SDK reads each prompt's cached prefix as per-token K/V
   ``[2, L, T, kv_heads*head_size]``;
3. **edit** — drop every k-th token (K/V and id; the bench's strided-copy edit);
4. **store** — the SDK stores the edit under the edited token ids (whole chunks);
5. **re-serve** — the engine runs the edited prompts and loads the edited prefixes from
   LMCache (external prefix hits, checked against what was stored).

Paths, side by side in one run, on the same engine and server, alternating order per rep:

* ``kvfast`` — this SDK, a plain ``connect()`` (the geometry is found, not given), a
  sequential retrieve / edit / store loop; the conversion between the engine's rows and
  per-token K/V happens inside ``retrieve`` / ``store``;
* ``kvfast batch.rewrite`` — the same through :func:`lmcache_kv_fast.batch.rewrite`;
* ``upstream`` — LMCache 0.5.6's own SDK, the same loop. It finds no layout for an
  engine-driven registration and hands out the engine's raw rows, so (as a user would
  have to) it gets the layout supplied (a vLLM-style registration of the single-plane
  rows while it connects) and the rows converted to per-token K/V and back around its
  calls (with this SDK's converter, timed within its retrieve / store). Its ``store``
  cannot write single-plane objects over SHM at all (a 4-D slice copied into a 3-D slot),
  so the edit is stored through its same store flow with that copy fixed
  (:func:`testbed.upstream_cpu.store_rows`).

Reported per path (medians over reps): each phase's seconds, the SDK's share of the loop
(retrieve + edit + store over all five), prompts/s and GB/s (per-token KV retrieved plus
stored, over the SDK's time), and the upstream / kvfast ratio of the SDK time. The
upstream SDK runs in this process (the other workloads give it its own interpreter).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .edits import drop_every_kth

logger = logging.getLogger(__name__)

KVF, KVF_BATCH, UP = "kvfast", "kvfast batch.rewrite", "upstream"
PHASES = ("prefill", "retrieve", "edit", "store", "re-serve")
SDK_PHASES = ("retrieve", "edit", "store")


@dataclass
class W5Sizes:
    """W5's sizes (``--engine-*`` flags; ``--quick`` shrinks them)."""

    prompts: int = 16
    tokens: int = 1040
    reps: int = 3
    #: Untimed passes of every path first (first-call costs: page faults, torch kernels).
    warmup: int = 1
    k: int = 10
    chunk: int = 256
    block: int = 128


W5_QUICK = {"prompts": 3, "tokens": 528, "reps": 1}


@dataclass
class Rep:
    """One rep of one path."""

    seconds: dict[str, float]
    moved_bytes: int
    hits: list[int]
    expected: list[int]
    error: str = ""

    @property
    def ok(self) -> bool:
        """Whether every prompt came back edited and the engine hit every stored chunk."""
        return not self.error and self.hits == self.expected


@dataclass
class PathResult:
    """Every rep of one path."""

    name: str
    reps: list[Rep] = field(default_factory=list)
    note: str = ""

    def median(self, phase: str) -> float:
        """Median seconds of a phase over the good reps (nan without one)."""
        xs = [r.seconds.get(phase, 0.0) for r in self.reps if r.ok]
        return statistics.median(xs) if xs else float("nan")

    def sdk(self) -> float:
        """Median SDK seconds per rep: retrieve + edit + store (batch.rewrite: its wall time)."""
        xs = [_sdk_s(r) for r in self.reps if r.ok]
        return statistics.median(xs) if xs else float("nan")

    def loop(self) -> float:
        """Median seconds of the whole loop per rep (prefill + SDK + re-serve)."""
        xs = [r.seconds.get("prefill", 0.0) + _sdk_s(r) + r.seconds.get("re-serve", 0.0)
              for r in self.reps if r.ok]
        return statistics.median(xs) if xs else float("nan")


def _sdk_s(r: Rep) -> float:
    wall = r.seconds.get("sdk_wall")
    return wall if wall is not None else sum(r.seconds.get(p, 0.0) for p in SDK_PHASES)


# ---------------------------------------------------------------------------- paths
class _KvfPath:
    """This SDK: plain connect(); a sequential loop or batch.rewrite."""

    def __init__(self, name: str, ctx: Any, s: W5Sizes) -> None:
        self.name, self.ctx, self.s = name, ctx, s

    def loop(self, prompts: list[list[int]], secs: dict[str, float]) -> tuple[int, str]:
        ctx, k = self.ctx, self.s.k
        if self.name == KVF_BATCH:
            from lmcache_kv_fast import batch

            def fn(kv: Any, toks: Any, *, alloc: Callable[..., Any]) -> Any:
                return drop_every_kth(kv, toks, k, alloc=alloc)

            rep = batch.rewrite(ctx, prompts, fn, progress=False)
            secs.update({"retrieve": rep.stage_seconds.get("retrieve", 0.0),
                         "edit": rep.stage_seconds.get("fn", 0.0),
                         "store": rep.stage_seconds.get("store", 0.0),
                         # its stages may overlap (several workers): the SDK time is its wall
                         "sdk_wall": rep.seconds})
            err = "" if rep.ok == len(prompts) else f"batch.rewrite: {rep.summary()}"
            return rep.bytes_moved, err
        moved = 0
        for p in prompts:
            t0 = time.perf_counter()
            kv = ctx.retrieve(p)
            t1 = time.perf_counter()
            if kv is None:
                return moved, "a prefilled prompt was not cached"
            new_kv, new_toks = drop_every_kth(kv, p[: kv.shape[-2]], k)
            t2 = time.perf_counter()
            res = ctx.store_ex(new_kv, new_toks)
            t3 = time.perf_counter()
            if not res.ok:
                return moved, f"store of an edit: {res}"
            per_tok = kv.element_size() * kv.numel() // kv.shape[-2]
            moved += per_tok * (kv.shape[-2] + res.tokens_stored)
            for ph, dt in (("retrieve", t1 - t0), ("edit", t2 - t1), ("store", t3 - t2)):
                secs[ph] = secs.get(ph, 0.0) + dt
        return moved, ""


class _UpstreamPath:
    """LMCache 0.5.6's SDK with the layout supplied and the rows converted around it."""

    name = UP

    def __init__(self, ctx: Any, cpu: Any, s: W5Sizes) -> None:
        self.ctx, self.cpu, self.s = ctx, cpu, s
        self.convert_s = 0.0

    def loop(self, prompts: list[list[int]], secs: dict[str, float]) -> tuple[int, str]:
        from testbed.upstream_cpu import store_rows

        cpu, k, c = self.cpu, self.s.k, self.s.chunk
        lay = cpu.raw_layout
        moved = 0
        for p in prompts:
            t0 = time.perf_counter()
            raw = self.ctx.retrieve(p)
            tc = time.perf_counter()
            if raw is None:
                return moved, "a prefilled prompt was not cached"
            kv = cpu.to_tokens(raw.reshape(lay.num_layers, -1, lay.hidden_size))
            t1 = time.perf_counter()
            new_kv, new_toks = drop_every_kth(kv, p[: kv.shape[-2]], k)
            t2 = time.perf_counter()
            whole = len(new_toks) // c * c
            rows = cpu.to_raw(new_kv.narrow(-2, 0, whole))
            tc2 = time.perf_counter()
            ok = store_rows(self.ctx, rows, new_toks[:whole])
            t3 = time.perf_counter()
            if not ok:
                return moved, "upstream store of an edit returned False"
            self.convert_s += (t1 - tc) + (tc2 - t2)
            per_tok = kv.element_size() * kv.numel() // kv.shape[-2]
            moved += per_tok * (kv.shape[-2] + whole)
            for ph, dt in (("retrieve", t1 - t0), ("edit", t2 - t1), ("store", t3 - t2)):
                secs[ph] = secs.get(ph, 0.0) + dt
        return moved, ""


def _version_skew(server_version: str) -> str | None:
    """Why this process's lmcache SDK cannot serve as the upstream path, or None.

    W5 runs upstream in this process: an SDK of another release than the server's does not
    speak its dialect (0.5.6's SDK gets no reply from a 0.5.7 server).
    """
    from importlib.metadata import version

    from lmcache_kv_fast.protocol.ops import generation_for

    ours = version("lmcache")
    if generation_for(ours) is generation_for(server_version):
        return None
    return (f"this process's lmcache {ours} SDK does not speak the server's "
            f"{server_version} dialect (W5 runs upstream in-process)")


def _connect_upstream(url: str, http_url: str, model: str, cpu: Any) -> Any:
    """Upstream's context, given the engine's single-plane rows as a vLLM-style layout."""
    import lmcache.sdk.kvcache as upstream

    from testbed.upstream_cpu import register_rows_layout

    reg = register_rows_layout(url, model, cpu)
    try:
        return upstream.connect(url, http_url, model, timeout=60)
    finally:
        reg.unregister()  # only its connect reads it; nobody else should see it


# ---------------------------------------------------------------------------- the loop
def _prompts(s: W5Sizes, seed: int) -> list[list[int]]:
    rng = random.Random(f"W5-{seed}")  # not an int seed: other users of the engine use those
    return [[rng.randrange(3, 1024) for _ in range(s.tokens)] for _ in range(s.prompts)]


def _expected_hit(s: W5Sizes) -> int:
    """Tokens the engine must load for an edited prompt: the stored whole chunks."""
    hit = s.tokens // s.chunk * s.chunk
    return (hit - hit // s.k) // s.chunk * s.chunk


def run_rep(engine: Any, path: Any, s: W5Sizes, seed: int) -> Rep:
    """One pass of the loop for one path (fresh prompts: no earlier hit)."""
    prompts = _prompts(s, seed)
    secs: dict[str, float] = {}
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    gens = engine.generate(prompts, max_tokens=1)
    secs["prefill"] = time.perf_counter() - t0
    if any(g.num_cached_tokens for g in gens):
        return Rep(secs, 0, [], [], "the prompts were cached before the prefill")
    moved, err = path.loop(prompts, secs)
    if err:
        return Rep(secs, moved, [], [], err)
    edited = [[t for i, t in enumerate(p) if (i + 1) % s.k] for p in prompts]
    engine.reset_prefix_cache()  # hits can only come from LMCache
    t0 = time.perf_counter()
    gens = engine.generate(edited, max_tokens=1)
    secs["re-serve"] = time.perf_counter() - t0
    hits = [g.num_cached_tokens for g in gens]
    return Rep(secs, moved, hits, [_expected_hit(s)] * s.prompts)


def _run_reps(engine: Any, paths: list[Any], s: W5Sizes) -> list[PathResult]:
    """Every path's warm-up and timed reps, the paths' order alternating from rep to rep.

    A warm-up rep is kept only when it failed (so the verdict sees it).
    """
    results = [PathResult(p.name) for p in paths]
    for rep in range(s.warmup + s.reps):
        order = list(range(len(paths)))
        if rep % 2:
            order.reverse()
        for j in order:
            if rep == s.warmup and isinstance(paths[j], _UpstreamPath):
                paths[j].convert_s = 0.0
            r = run_rep(engine, paths[j], s, seed=1000 * rep + j)
            what = "warm-up" if rep < s.warmup else "rep"
            logger.info("W5 %s %d %s: %s", what, rep, paths[j].name,
                        "ok" if r.ok else f"FAILED {r.error or (r.hits, r.expected)}")
            if rep >= s.warmup or not r.ok:
                results[j].reps.append(r)
    return results


def run_w5(args: argparse.Namespace, *, server: Any = None, engine: Any = None) -> int:
    """Run W5 and print its table; 0 when every path's every rep was right.

    Args:
        args: The ``bench`` flags.
        server: A running LMCache server (chunk 256) to use instead of starting one
            (``engine`` too).
        engine: A running :class:`~testbed.engine.OfflineEngine` of the tiny
            model (block 128) on ``server`` (the tests share theirs).
    """
    import lmcache_kv_fast as lkf
    from lmcache_kv_fast.testing import LMCacheServer
    from lmcache_kv_fast.testing.register import unregister_engine_driven
    from testbed.engine import OfflineEngine
    from testbed.tiny_model import ensure_tiny_model

    s = sizes_from_args(args)
    t_start = time.perf_counter()
    results: list[PathResult] = []
    setup: dict[str, float] = {}
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        model = str(ensure_tiny_model())
        if server is None or engine is None:
            server = stack.enter_context(LMCacheServer(shm=True, chunk_size=s.chunk,
                                                       l1_size_gb=1.0))
            setup["server + model"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine = stack.enter_context(OfflineEngine(model, server.port, block_size=s.block))
            setup["engine start"] = time.perf_counter() - t0
        engine.generate([_prompts(W5Sizes(prompts=1, tokens=64), 99)[0]], max_tokens=1)  # warm
        t0 = time.perf_counter()
        ctx = stack.enter_context(lkf.connect(server.url, server.http_url, model, timeout=60))
        setup["kvfast connect"] = time.perf_counter() - t0
        if ctx.engine_kv is None:
            raise SystemExit(f"W5: connect() found no CPU engine for {model!r}")
        paths: list[Any] = [_KvfPath(KVF, ctx, s), _KvfPath(KVF_BATCH, ctx, s)]
        up_ok = not args.no_upstream and importlib.util.find_spec("lmcache") is not None
        skew = _version_skew(ctx.server_version) if up_ok else None
        if skew is not None:
            up_ok = False
            notes.append(f"upstream path skipped: {skew}")
        if up_ok:
            t0 = time.perf_counter()
            up = _connect_upstream(server.url, server.http_url, model, ctx.engine_kv)
            # its close() leaves the registration to the server's reaper (an hour): drop it
            stack.callback(unregister_engine_driven, server.url, up.instance_id)
            stack.callback(up.close)
            setup["upstream connect (layout supplied)"] = time.perf_counter() - t0
            paths.append(_UpstreamPath(up, ctx.engine_kv, s))
        elif skew is None:
            notes.append("upstream path skipped: " + ("--no-upstream" if args.no_upstream
                                                      else "lmcache is not importable"))
        results = _run_reps(engine, paths, s)
        for p, res in zip(paths, results, strict=True):
            if isinstance(p, _UpstreamPath):
                res.note = (f"converting rows <-> per-token K/V around it: "
                            f"{p.convert_s / max(1, s.reps):.3f} s per rep (in its "
                            "retrieve/store)")
        desc = ctx.engine_kv.describe()
    elapsed = time.perf_counter() - t_start
    print_w5(results, s, desc, setup, notes, elapsed)
    if args.json:
        Path(args.json).write_text(json.dumps(w5_doc(results, s, desc, setup, notes, elapsed),
                                              indent=1))
        print(f"wrote {args.json}")
    return 0 if all(r.ok for res in results for r in res.reps) and results else 1


def sizes_from_args(args: argparse.Namespace) -> W5Sizes:
    """W5 sizes from ``--quick`` and the ``--engine-*`` flags."""
    s = W5Sizes(chunk=args.chunk_size, **(W5_QUICK if args.quick else {}))
    for flag in ("prompts", "tokens", "reps"):
        v = getattr(args, f"engine_{flag}", None)
        if v is not None:
            if v < 1:
                raise SystemExit(f"--engine-{flag} must be positive")
            setattr(s, flag, v)
    if s.chunk % s.block:
        raise SystemExit(f"--chunk-size must be a multiple of the engine block size {s.block}")
    if s.tokens < s.chunk or s.tokens > 2000:
        raise SystemExit(f"--engine-tokens must be in [{s.chunk}, 2000] (one chunk at least; "
                         "the engine's max_model_len is 2048)")
    return s


# ---------------------------------------------------------------------------- report
def _row(res: PathResult, s: W5Sizes) -> dict[str, Any]:
    good = [r for r in res.reps if r.ok]
    sdk, loop = res.sdk(), res.loop()
    moved = statistics.median(r.moved_bytes for r in good) if good else 0
    return {
        "path": res.name, "ok_reps": len(good), "reps": len(res.reps),
        **{ph: res.median(ph) for ph in PHASES}, "sdk_s": sdk, "loop_s": loop,
        "sdk_share": sdk / loop if loop == loop and loop > 0 else float("nan"),
        "sdk_prompts_per_s": s.prompts / sdk if sdk == sdk and sdk > 0 else float("nan"),
        "loop_prompts_per_s": s.prompts / loop if loop == loop and loop > 0 else float("nan"),
        "sdk_gbps": moved / sdk / 1e9 if sdk == sdk and sdk > 0 else float("nan"),
        "moved_bytes": moved,
        "errors": [r.error or f"hits {r.hits} != expected {r.expected}"
                   for r in res.reps if not r.ok],
        "note": res.note,
    }


def print_w5(results: list[PathResult], s: W5Sizes, desc: str, setup: dict[str, float],
             notes: list[str], elapsed: float) -> None:
    """The W5 table: phases, SDK share, throughput, ratio vs upstream."""
    print(f"\nW5 engine loop: {s.prompts} prompts x {s.tokens} tokens, drop every {s.k}th "
          f"token, {s.reps} rep(s) after {s.warmup} warm-up, chunk {s.chunk}; {desc}")
    print("setup: " + ", ".join(f"{k} {v:.1f} s" for k, v in setup.items()))
    rows = [_row(r, s) for r in results]
    head = (f"{'path':<22}{'prefill':>9}{'retrieve':>10}{'edit':>8}{'store':>8}"
            f"{'re-serve':>10}{'loop':>8}{'SDK':>8}{'SDK share':>10}{'SDK p/s':>9}"
            f"{'loop p/s':>9}{'SDK GB/s':>9}  ok")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['path']:<22}{r['prefill']:>9.3f}{r['retrieve']:>10.3f}{r['edit']:>8.3f}"
              f"{r['store']:>8.3f}{r['re-serve']:>10.3f}{r['loop_s']:>8.3f}{r['sdk_s']:>8.3f}"
              f"{r['sdk_share']:>10.1%}{r['sdk_prompts_per_s']:>9.1f}"
              f"{r['loop_prompts_per_s']:>9.1f}{r['sdk_gbps']:>9.3f}  {r['ok_reps']}/{r['reps']}")
    print("(seconds per rep, medians; SDK = retrieve + edit + store, for batch.rewrite its wall "
          "time (its stage columns are summed over items); GB/s = per-token KV retrieved + "
          "stored over the SDK time)")
    by = {r["path"]: r for r in rows}
    if UP in by and KVF in by:
        for mine in (KVF, KVF_BATCH):
            a, b = by[UP]["sdk_s"], by[mine]["sdk_s"]
            if a == a and b == b and b > 0:
                print(f"upstream / {mine}: SDK time x{a / b:.2f}, loop time "
                      f"x{by[UP]['loop_s'] / by[mine]['loop_s']:.2f}")
    for r in rows:
        if r["note"]:
            print(f"note: {r['path']}: {r['note']}")
        for e in r["errors"]:
            print(f"ERROR: {r['path']}: {e}")
    for n in notes:
        print(f"note: {n}")
    print(f"\ntotal {elapsed:.1f} s")


def w5_doc(results: list[PathResult], s: W5Sizes, desc: str, setup: dict[str, float],
           notes: list[str], elapsed: float) -> dict[str, Any]:
    """Everything W5 measured, for ``--json``."""
    return {"workload": "W5", "sizes": asdict(s), "engine": desc, "setup_s": setup,
            "rows": [_row(r, s) for r in results],
            "reps": {r.name: [asdict(x) for x in r.reps] for r in results},
            "notes": notes, "elapsed_s": elapsed}
