"""Benchmark harness: ``lmcache-kv-fast bench`` (also ``python -m lmcache_kv_fast bench``).

The command line: flags, sizes, which workers to start; then :func:`.runner.run` and the
report (:mod:`.report`, :mod:`.targets`, :mod:`.plot`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .edits import EDITS
from .plot import write_plot
from .report import (
    json_doc,
    merge_pings,
    phase_summary,
    print_header,
    print_ic,
    print_latency,
    print_phases,
    print_table,
)
from .runner import run
from .servers import machine_description
from .sizes import QUICK, SHM_CAP_GIB, MiB, Sizes, kv_nbytes, shm_l1_gib
from .stats import add_ratios, rows_of
from .targets import compute_targets, print_targets, reduced_sizes
from .w6 import add_w6_args, run_w6
from .w6 import write_json as write_w6_json
from .workloads import ENGINE_WORKLOADS, OPTIONAL_WORKLOADS, WORKLOADS

#: The workloads run without ``--engine`` when none are named.
DEFAULT_WORKLOADS = tuple(w for w in WORKLOADS
                          if w not in ENGINE_WORKLOADS and w not in OPTIONAL_WORKLOADS)


def thread_list(text: str | None, cores: int) -> list[int]:
    """``--threads`` (else 1..cores, or powers of two and ``cores`` above 4 cores)."""
    if text:
        return sorted({max(1, int(x)) for x in text.split(",") if x.strip()})
    if cores <= 4:
        return list(range(1, cores + 1))
    out = [1]
    while out[-1] * 2 < cores:
        out.append(out[-1] * 2)
    return [*out, cores]


def build_parser() -> argparse.ArgumentParser:
    """The ``bench`` command line."""
    ap = argparse.ArgumentParser(prog="lmcache-kv-fast bench", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("servers")
    g.add_argument("--url", help="ZMQ URL of an SHM server to use (else one is started)")
    g.add_argument("--http-url", help="its HTTP URL")
    g.add_argument("--pickle-url", help="ZMQ URL of a pickle-plane server (else one is started)")
    g.add_argument("--pickle-http-url", help="its HTTP URL")
    g.add_argument("--l1-gb", type=float, help="L1 of the started SHM server (default: sized "
                   f"from the workloads, <= {SHM_CAP_GIB:g})")
    g.add_argument("--pickle-l1-gb", type=float, help="L1 of the started pickle server")
    g.add_argument("--chunk-size", type=int, default=256)
    g.add_argument("--transport", choices=("zmq", "grpc"), default="zmq",
                   help="control plane of the started servers; both SDKs use it (grpc: "
                        "--transport grpc, grpc:// URLs; needs grpcio)")
    g.add_argument("--server-version", metavar="VER",
                   help="start servers of this LMCache version (e.g. 0.5.7rc2) from its venv "
                        ".venv-compat/VER (scripts/compat-venvs.sh VER); the upstream path "
                        "is that version's own SDK")
    g.add_argument("--server-malloc", choices=("tuned", "default"), default="tuned",
                   help="glibc settings of the servers started here: 'tuned' (docs/deployment.md's "
                        "deployment settings: MALLOC_ARENA_MAX=1, 512 MiB mmap threshold; "
                        "the pickle plane's server work 2-3x faster for every client) or "
                        "glibc's 'default'")
    g = ap.add_argument_group("what to run")
    g.add_argument("--quick", action="store_true",
                   help="CI-sized run (< 2 minutes; its target verdicts are only indicative)")
    g.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"subset of {','.join(DEFAULT_WORKLOADS)} (W5: --engine; W3P: W3 "
                        "with the plain edit fn, no alloc), or W7 / W3F (only when named). W7: "
                        "SnapKV + re-rotation at Llama-3.2-1B's geometry, batch.rewrite vs "
                        "upstream's loop in plain torch. W3F: batch.rewrite of W3's sequences "
                        "with W3P's plain fn vs the fused edits.drop_every(k) [+ llama3 rope] "
                        "vs a flat memcpy of the input (native worker only)")
    g.add_argument("--engine", action="store_true",
                   help="run W5, the engine loop, instead: a real vLLM CPU engine (.venv-engine, "
                        "scripts/engine-venv.sh) prefills N prompts, the SDK retrieves per-token "
                        "K/V, drops every k-th token and stores the edit, the engine re-serves "
                        "them; this SDK and upstream side by side")
    g.add_argument("--threads", help="native copy thread counts, e.g. 1,2 (default 1..cores)")
    g.add_argument("--no-upstream", action="store_true", help="skip the upstream SDK paths")
    g.add_argument("--no-torch-backend", action="store_true", help="skip the torch backend path")
    g = ap.add_argument_group("sizes (defaults: the issue's; --quick shrinks them)")
    g.add_argument("--w1-layers", type=int)
    g.add_argument("--w1-tokens", type=int)
    g.add_argument("--w2-layers", type=int)
    g.add_argument("--w2-ops", type=int)
    g.add_argument("--w3-sequences", type=int, help="W3, W3P and W3F sequences (W3P: W3 with "
                   "the plain edit users write, kv.index_select(2, torch.tensor(keep)), given "
                   "to batch.rewrite, this SDK's loop and upstream's loop alike; W3F: that fn "
                   "vs the fused library drop; same sizes)")
    g.add_argument("--w3-tokens", type=int)
    g.add_argument("--w3-reps", type=int)
    g.add_argument("--w3-drop-k", type=int)
    g.add_argument("--w3-edit", choices=list(EDITS), default=next(iter(EDITS)),
                   help="W3's drop: one strided copy, or demo.drop_every_kth's index_select")
    g.add_argument("--w3-no-alloc", action="store_true",
                   help="W3's batch edit ignores rewrite's pooled output allocator (allocates "
                        "fresh memory like the sequential loop)")
    g.add_argument("--w7-sequences", type=int, help="W7 sequences (default 16, quick 3)")
    g.add_argument("--w7-tokens", type=int, help="W7 tokens per sequence (default 2048)")
    g.add_argument("--w7-reps", type=int, help="W7 timed reps (default 2)")
    g.add_argument("--w4-mib", type=float, help="W4 tensor size (rounded to whole chunks)")
    g.add_argument("--reps", type=int, help="timed reps of W1 ops")
    g.add_argument("--warmup", type=int, help="untimed warm-up reps")
    g.add_argument("--ic-reps", type=int, help="fresh interpreters per import+connect kind")
    g.add_argument("--engine-prompts", type=int, help="W5 prompts per rep (default 16, quick 3)")
    g.add_argument("--engine-tokens", type=int, help="W5 prompt length (default 1040, quick 528)")
    g.add_argument("--engine-reps", type=int, help="W5 reps per path (default 3, quick 1)")
    add_w6_args(ap)
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write every sample and the machine here")
    g.add_argument("--plot", metavar="PATH.png", help="bar chart + W2 latency CDF (matplotlib)")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--worker-timeout", type=float, help="seconds a worker may take for one "
                   "step (default 900, quick 200)")
    return ap


def resolve_sizes(args: argparse.Namespace) -> Sizes:
    """Sizes from ``--quick`` and the size flags."""
    s = Sizes(chunk=args.chunk_size, **(QUICK if args.quick else {}))
    for flag, attr in [("w1_layers", "w1_layers"), ("w1_tokens", "w1_tokens"),
                       ("w2_layers", "w2_layers"), ("w2_ops", "w2_ops"),
                       ("w3_sequences", "w3_sequences"), ("w3_tokens", "w3_tokens"),
                       ("w3_reps", "w3_reps"), ("w3_drop_k", "w3_k"), ("reps", "reps"),
                       ("w7_sequences", "w7_sequences"), ("w7_tokens", "w7_tokens"),
                       ("w7_reps", "w7_reps"),
                       ("warmup", "warmup"), ("ic_reps", "ic_reps")]:
        v = getattr(args, flag)
        if v is not None:
            if v < (0 if flag == "warmup" else 1):
                raise SystemExit(f"--{flag.replace('_', '-')} must be positive")
            setattr(s, attr, v)
    if args.w4_mib is not None:
        per_chunk = kv_nbytes(s.w1_layers, s.chunk)
        s.w4_tokens = max(1, round(args.w4_mib * MiB / per_chunk)) * s.chunk
    for name in ("w1_tokens", "w3_tokens", "w4_tokens", "w7_tokens"):
        v = getattr(s, name)
        if v % s.chunk:
            setattr(s, name, max(s.chunk, v // s.chunk * s.chunk))
    return s


def _fit_w3(s: Sizes, notes: list[str]) -> None:
    """Shrink W3's sequence count until its working set fits the SHM cap."""
    orig = s.w3_sequences
    while s.w3_sequences > 1 and shm_l1_gib(s, ["W3"]) > SHM_CAP_GIB:
        s.w3_sequences -= 1
    if s.w3_sequences != orig:
        notes.append(f"W3: {orig} sequences do not fit {SHM_CAP_GIB:g} GiB of L1 SHM with the "
                     f"0.8 watermark; using {s.w3_sequences}")


def main(argv: list[str]) -> int:
    """Run the benchmark (``lmcache-kv-fast bench``); 0 when every worker completed."""
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if bool(args.url) != bool(args.http_url) or bool(args.pickle_url) != bool(args.pickle_http_url):
        raise SystemExit("--url and --http-url (and --pickle-url / --pickle-http-url) go together")
    t_start = time.perf_counter()
    picked = {w.strip().upper() for w in args.workloads.split(",") if w.strip()}
    with _sigterm_as_interrupt():
        if args.engine or picked & set(ENGINE_WORKLOADS):
            from .engine_loop import run_w5  # imports the SDK and the engine fixtures

            return run_w5(args)
        if args.w6:
            doc = run_w6(args)
            if args.json:
                write_w6_json(doc, args.json)
            return 0
        return _main(args, t_start)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt (main thread only) so every server is stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _main(args: argparse.Namespace, t_start: float) -> int:
    notes: list[str] = []
    workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workloads {bad}; choose from {','.join(WORKLOADS)}")
    s = resolve_sizes(args)
    if any(w in workloads for w in ("W3", "W3P", "W3F")) and not args.l1_gb:
        _fit_w3(s, notes)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = thread_list(args.threads, cores)
    default_threads = int(os.environ.get("LMCACHE_KV_FAST_THREADS") or cores)
    if default_threads not in threads:
        threads = sorted({*threads, default_threads})
    machine = machine_description()
    up_ok = not args.no_upstream and importlib.util.find_spec("lmcache") is not None
    if not up_ok:
        notes.append("upstream SDK paths skipped: " + ("--no-upstream" if args.no_upstream
                                                       else "lmcache is not importable"))
    native_ok = str(machine.get("default_backend")) == "native"
    if not native_ok:
        notes.append("native backend unavailable: native paths and the roofline skipped")
    workers = (["native"] if native_ok else []) + ([] if args.no_torch_backend else ["torch"]) + \
        (["upstream"] if up_ok else [])
    timeout = args.worker_timeout or (200.0 if args.quick else 900.0)

    res = run(args, s, workloads, threads=threads, default_threads=default_threads,
              workers=workers, with_upstream=up_ok, timeout=timeout, notes=notes)
    records, ic, infos, errors = res.records, res.ic, res.infos, res.errors

    rows = rows_of(records)
    add_ratios(rows, records, default_threads)
    targets = compute_targets(rows, records, ic, default_threads)
    elapsed = time.perf_counter() - t_start
    print_header(machine, s, shm_l1=res.servers["shm"]["l1_gib"],
                 pick_l1=(res.servers["pickle"] or {}).get("l1_gib"), threads=threads,
                 infos=infos, server_version=res.servers["shm"].get("version"),
                 w3_edit=args.w3_edit, w3_no_alloc=args.w3_no_alloc,
                 server_malloc=(res.servers["pickle"] or res.servers["shm"]).get("malloc"))
    print_table(rows, records)
    if any(o.startswith("W2") for (_p, o) in rows):
        print_latency(rows)
    phases = phase_summary(records, default_threads, merge_pings(infos))
    print_phases(phases, default_threads)
    if ic:
        print_ic(ic)
    reduced = reduced_sizes(s)
    print_targets(targets, reduced=reduced)
    for n in notes:
        print(f"note: {n.splitlines()[0][:300]}")
    for e in errors:
        print(f"ERROR: {e}")
    print(f"\ntotal {elapsed:.1f} s")
    if args.json:
        doc = json_doc(machine=machine, s=s, threads=threads, default_threads=default_threads,
                       workloads=workloads, servers=res.servers, infos=infos, args=vars(args),
                       records=records, rows=rows, phases=phases, ic=ic, targets=targets,
                       reduced=reduced, notes=notes, errors=errors, elapsed=elapsed,
                       steps=res.steps)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        msg = write_plot(args.plot, rows, records)
        print(f"note: {msg}" if msg else f"wrote {args.plot}")
    return 1 if errors else 0
