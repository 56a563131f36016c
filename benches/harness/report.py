"""What ``bench`` prints and writes: header, table, latency, phases, import+connect, JSON.

The targets section is :func:`.targets.print_targets`, the plot :func:`.plot.write_plot`.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .names import (
    IC_KVF,
    IC_TORCH,
    IC_UP,
    KVF_PICKLE,
    W2_COPY,
    W2_RET,
    W2_STORE,
    W3F_COPY,
    kvf_native,
)
from .sizes import HIDDEN, MiB, Sizes
from .stats import Key, Row, fmt, roofline_ref, threads_of
from .targets import Target
from .workloads import OP_ORDER


def path_order(paths: Sequence[str]) -> list[str]:
    """Paths in table order: rooflines, this SDK's native paths by threads, ours, upstream."""
    def key(p: str) -> tuple[int, int, str]:
        group = (0 if p.startswith("roofline") else 1 if p.startswith("kvfast-native-")
                 else 2 if p.startswith("kvfast") else 3)
        return group, threads_of(p) or 0, p
    return sorted(paths, key=key)


def print_header(machine: dict[str, Any], s: Sizes, *, shm_l1: float, pick_l1: float | None,
                 threads: Sequence[int], infos: Sequence[dict[str, Any]],
                 server_version: str | None, w3_edit: str,
                 w3_no_alloc: bool = False,
                 server_malloc: dict[str, str] | None = None) -> None:
    """Print the machine, the sizes, the servers' allocator, the native core and checks."""
    print("\n== lmcache-kv-fast bench")
    print(f"machine: {machine.get('cpu', '?')}, {machine.get('usable_cores')} usable cores, "
          f"{machine.get('memory_gib')} GiB, THP {machine.get('thp', '?')}; python "
          f"{machine['python']}, torch {machine['torch']}, lmcache {machine['lmcache']}, "
          f"lmcache-kv-fast {machine.get('lmcache_kv_fast')}; server {server_version}")
    print(f"W1 [2, {s.w1_layers}, {s.w1_tokens}, {HIDDEN}] bf16 = {s.w1_bytes / MiB:.0f} MiB, "
          f"{s.reps} reps + {s.warmup} warm-up; W2 [2, {s.w2_layers}, {s.chunk}, {HIDDEN}] = "
          f"{s.w2_bytes / MiB:.0f} MiB x {s.w2_ops} ops; W3 {s.w3_sequences} x {s.w3_tokens} "
          f"tokens (drop every {s.w3_k}th by {w3_edit}"
          f"{', batch without alloc' if w3_no_alloc else ''}; W3P: the plain index_select "
          f"fn), {s.w3_reps} reps + {s.w3_warmup} warm-up; W4 {s.w4_bytes / MiB:.0f} MiB x "
          f"{s.w4_reps}; L1: SHM {shm_l1:g} GiB, pickle {pick_l1 if pick_l1 is not None else '-'} "
          f"GiB; native copy threads {list(threads)}")
    if server_malloc is not None:
        desc = " ".join(f"{k}={v}" for k, v in server_malloc.items()) or "glibc defaults"
        print(f"started servers' allocator: {desc} (--server-malloc; same for both SDKs)")
    for info in infos:
        if info.get("native_config"):
            print(f"native core: {info['native_config']}")
            break
    checks = {f"{info.get('worker')}.{k}": v for info in infos for k, v in info.items()
              if k.endswith("_exact")}
    if checks:
        print("read-back checks: " + ", ".join(f"{k}={v}" for k, v in sorted(checks.items())))


def print_table(rows: dict[Key, Row], records: dict[Key, dict[str, Any]],
                out: Any = None) -> None:
    """Print the per path x workload table (seconds, GB/s, ratios)."""
    out = out or sys.stdout
    hdr = (f"{'workload':22s} {'path':22s} {'n':>4s} {'min s':>9s} {'median s':>9s} "
           f"{'p90 s':>9s} {'GB/s':>7s} {'x roof':>7s} {'x up':>6s}")
    print("\n" + hdr, file=out)
    print("-" * len(hdr), file=out)
    for op in OP_ORDER:
        paths = path_order([p for (p, o) in records if o == op])
        for p in paths:
            row = rows.get((p, op))
            if row is None:
                rec = records[(p, op)]
                print(f"{op:22s} {p:22s} {'0':>4s}  FAILED ({rec.get('failures', 0)}): "
                      f"{str(rec.get('note', ''))[:70]}", file=out)
                continue
            fails = f"  ({row.failures} failed)" if row.failures else ""
            print(f"{op:22s} {p:22s} {row.n:4d} {row.min:9.4f} {row.median:9.4f} "
                  f"{row.p90:9.4f} {row.gbps:7.2f} {fmt(row.x_roofline):>7s} "
                  f"{fmt(row.x_upstream):>6s}{fails}", file=out)
        if paths:
            print(file=out)
    print("x roof: fraction of a flat memcpy of the same bytes timed in the same reps (same copy "
          "threads; cold rows: into fresh anonymous / fresh /dev/shm pages); x up: speed-up over "
          "upstream (retrieve+out and W3/W3P batch vs upstream's drop-in retrieve / sequential loop;"
          " upstream's drop-in retrieve is timed in the retrieve+out reps too, and its row counts"
          " both); both the median of per-rep ratios where the two ran in the same reps, else "
          "the ratio of medians", file=out)
    if any(o == W3F_COPY for (_p, o) in records):
        print("W3F: x roof = the flat memcpy of the batch's input bytes (one sequence's bytes "
              "copied once per sequence between two pre-faulted buffers, summed) / the "
              "rewrite, in the same rep; GB/s: a rewrite's retrieved + stored bytes, the "
              "memcpy's input bytes", file=out)


def print_latency(rows: dict[Key, Row], out: Any = None) -> None:
    """Print W2 latency percentiles in ms."""
    out = out or sys.stdout
    hdr = f"{'W2 latency':14s} {'path':22s} {'n':>4s} {'p50 ms':>8s} {'p90 ms':>8s} " \
          f"{'p99 ms':>8s} {'p50 / upstream':>15s}"
    print("\n" + hdr, file=out)
    print("-" * len(hdr), file=out)
    for op in (W2_STORE, W2_RET, W2_COPY):
        for p in path_order([p for (p, o) in rows if o == op]):
            r = rows[(p, op)]
            ratio = None if r.x_upstream is None else 1.0 / r.x_upstream
            print(f"{op:14s} {p:22s} {r.n:4d} {r.median * 1e3:8.2f} {r.p90 * 1e3:8.2f} "
                  f"{r.p99 * 1e3:8.2f} {fmt(ratio):>15s}", file=out)


def merge_pings(infos: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """The workers' ping round trips, per server and op (see ``Worker._ping``)."""
    out: dict[str, dict[str, list[float]]] = {}
    for info in infos:
        for server, ops in (info.get("ping_s") or {}).items():
            for op, xs in ops.items():
                out.setdefault(server, {}).setdefault(op, []).extend(xs)
    return out


def phase_summary(records: dict[Key, dict[str, Any]],
                  default_threads: int,
                  pings: dict[str, dict[str, list[float]]] | None = None
                  ) -> list[dict[str, Any]]:
    """Median phases (``ctx.last_timing``) of this SDK's calls, per path and workload.

    ``copy_x_roof`` is the roofline copy's median time over the call's median copy time
    (1.0: the chunk copy runs as fast as a flat memcpy of the same bytes). With ``pings``
    (:func:`merge_pings`), ``ping_s`` is the median ``ping`` round trip to the path's server
    between the op's reps, ``rtt_s`` = (``rpcs`` - ``early_calls``) x ``ping_s`` (the
    replies' share that a no-op RPC costs too; a retrieve that read chunks early from
    read hints got its ``prepare_retrieve`` reply during a copy, which costs none;
    ``hinted_share`` is the share of chunks read early and kept) and ``server_s`` = ``wait_s`` - ``rtt_s``
    (the server's work on the calls' requests, queueing behind its own threads included);
    None without pings.
    """
    out: list[dict[str, Any]] = []
    for op in OP_ORDER:
        for path in path_order([p for (p, o) in records if o == op]):
            phases = records[(path, op)].get("phases") or []
            if not phases:
                continue
            med = {k: statistics.median(ph[k] for ph in phases)
                   for k in ("total_s", "wait_s", "copy_s", "alloc_s", "client_s", "rpcs",
                             "chunks")}
            # share of the calls' chunks read early from read hints and kept (context.py
            # _fetch), and of the calls that read any early: their prepare_retrieve reply
            # came during a copy
            moved = sum(ph["chunks"] for ph in phases)
            hinted = sum(ph.get("hinted", 0) for ph in phases) / moved if moved else 0.0
            early = sum(1 for ph in phases if ph.get("hinted", 0) + ph.get("rehinted", 0))
            early_calls = early / len(phases)
            ref = roofline_ref(path, op, default_threads)
            roof = records.get(ref) if ref else None
            x_roof = None
            if roof and roof["samples"] and med["copy_s"] > 0:
                x_roof = statistics.median(roof["samples"]) / med["copy_s"]
            server = "pickle" if path == KVF_PICKLE else "shm"
            xs = ((pings or {}).get(server) or {}).get(op) or []
            ping = statistics.median(xs) if xs else None
            rtt = None if ping is None else max(0.0, med["rpcs"] - early_calls) * ping
            out.append({"path": path, "op": op, "n": len(phases), **med, "copy_x_roof": x_roof,
                        "hinted_share": hinted, "early_calls": early_calls,
                        "ping_s": ping, "rtt_s": rtt,
                        "server_s": None if rtt is None else max(0.0, med["wait_s"] - rtt)})
    return out


def print_phases(phases: Sequence[dict[str, Any]], default_threads: int,
                 out: Any = None) -> None:
    """Print where the time of this SDK's calls goes (default-thread native and pickle)."""
    out = out or sys.stdout
    show = [p for p in phases if p["path"] in (kvf_native(default_threads), KVF_PICKLE)]
    if not show:
        return

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.2f}"

    def hinted(p: dict[str, Any]) -> str:
        return f"{p.get('hinted_share', 0.0):.0%}" if "retrieve" in p["op"] else "-"

    hdr = (f"{'where the time goes':22s} {'path':22s} {'total ms':>9s} {'waits ms':>9s} "
           f"{'rpcs':>5s} {'rtt ms':>7s} {'server ms':>9s} {'copy ms':>8s} {'alloc ms':>8s} "
           f"{'client ms':>9s} {'copy x roof':>11s} {'hinted':>6s}")
    print("\n" + hdr, file=out)
    print("-" * len(hdr), file=out)
    for p in show:
        print(f"{p['op']:22s} {p['path']:22s} {p['total_s'] * 1e3:9.2f} "
              f"{p['wait_s'] * 1e3:9.2f} {p['rpcs']:5.0f} {ms(p.get('rtt_s')):>7s} "
              f"{ms(p.get('server_s')):>9s} {p['copy_s'] * 1e3:8.2f} "
              f"{p['alloc_s'] * 1e3:8.2f} {p['client_s'] * 1e3:9.2f} "
              f"{fmt(p['copy_x_roof']):>11s} {hinted(p):>6s}", file=out)
    print("medians of ctx.last_timing per call: waits = blocked on server replies (a "
          "retrieve's commit is not awaited), split into rtt = rpcs (less prepare_retrieve "
          "replies that came while hinted chunks were copied) x the median round trip "
          "of a no-op ping between the reps and server = the rest (the server's own work on "
          "the requests); copy = the chunk scatter/gather, alloc = a drop-in retrieve's "
          "result buffer, client = the rest of the call; copy x roof = the flat-memcpy "
          "roofline's time / the copy's time; hinted = share of a retrieve's chunks read "
          "from where they lay last time before the prepare_retrieve reply came (read "
          "hints: the reps repeat one prefix)", file=out)


def ic_summary(ic: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Min / median of each import + connect part."""
    out: dict[str, dict[str, float]] = {}
    for k, parts in ic.items():
        for part, xs in parts.items():
            if xs:
                out.setdefault(k, {})[f"{part}_min"] = min(xs)
                out[k][f"{part}_median"] = statistics.median(xs)
    return out


def print_ic(ic: dict[str, dict[str, list[float]]], out: Any = None) -> None:
    """Print import + connect times (min / median seconds)."""
    out = out or sys.stdout
    summ = ic_summary(ic)
    cols = [("import torch", "torch"), ("import", "import"), ("connect", "connect"),
            ("import+connect", "total"), ("beyond torch", "own")]
    hdr = f"{'fresh interpreter':24s} {'n':>2s} " + " ".join(f"{c:>15s}" for c, _ in cols) + \
        f" {'wall':>6s}"
    print("\n" + hdr + "\n" + " " * 28 + "(seconds, min / median; 'beyond torch': the rest of "
          "the import after torch + connect, in the same interpreter)", file=out)
    print("-" * len(hdr), file=out)
    for k in (IC_TORCH, IC_KVF, IC_UP):
        s = summ.get(k)
        if not s:
            continue
        cells = [f"{s[p + '_min']:6.3f} /{s[p + '_median']:6.3f}" for _c, p in cols]
        print(f"{k:24s} {len(ic[k]['total']):2d} " + " ".join(f"{c:>15s}" for c in cells) +
              f" {s['process_median']:6.2f}", file=out)


def json_doc(*, machine: dict[str, Any], s: Sizes, threads: Sequence[int],
             default_threads: int, workloads: Sequence[str], servers: dict[str, Any],
             infos: Sequence[dict[str, Any]], args: dict[str, Any],
             records: dict[Key, dict[str, Any]], rows: dict[Key, Row],
             phases: Sequence[dict[str, Any]], ic: dict[str, dict[str, list[float]]],
             targets: Sequence[Target], reduced: Sequence[str], notes: Sequence[str],
             errors: Sequence[str], elapsed: float, steps: Sequence[tuple[str, float]]
             ) -> dict[str, Any]:
    """The ``--json`` document: every sample, the summary, the targets and the machine."""
    return {
        "machine": machine, "sizes": asdict(s), "threads": threads,
        "default_threads": default_threads, "workloads": workloads,
        "paths": sorted({p for (p, _o) in records}), "ops": [o for o in OP_ORDER
                                                             if any(k[1] == o for k in records)],
        "servers": servers, "workers": infos, "args": args,
        "records": list(records.values()),
        "summary": [{**asdict(r), "gbps": r.gbps} for r in rows.values()],
        "phases": phases,
        "import_connect": {"samples": ic, "summary": ic_summary(ic)},
        "targets": [{**asdict(t), "status": t.status, "reachable": t.reachable}
                    for t in targets],
        # the targets are defined on the issue's sizes: below them, verdicts are indicative
        "targets_indicative": bool(reduced), "reduced_sizes": reduced,
        "notes": notes, "errors": errors, "elapsed_s": elapsed,
        "step_seconds": steps,
    }
