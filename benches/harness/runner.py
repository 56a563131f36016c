"""One run: the servers, IC, then the workers driven in lock-step; returns every sample.

The workers live side by side and :func:`drive` runs them over stdin: op by op, rep by
rep, one worker after the other, each rep visiting every path of the worker (roofline
copies ride along in the native worker's reps). So every path of a workload is measured
in the same seconds, and drift or a neighbour's burst on a shared machine hits them all
alike. L1 is cleared before every op.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .helpers import http_clear, punch_segment
from .ic import run_ic
from .names import IC_KVF, IC_TORCH, IC_UP
from .procs import Progress, WorkerProc
from .servers import Server, register_models, server_python, servers
from .sizes import Sizes
from .stats import Key
from .workloads import GLOBAL_OPS, op_reps, worker_plan


def drive(procs: Sequence[WorkerProc], s: Sizes, server_urls: Sequence[str],
          progress: Progress, timeout: float, errors: list[str]) -> None:
    """Run every op: each rep of each worker in turn, so all paths share the same moments."""
    plans = {p.kind: worker_plan(p.spec) for p in procs}
    for op in GLOBAL_OPS:
        active = [p for p in procs if p.alive and op in plans[p.kind]]
        if not active:
            continue
        for http in server_urls:  # every op starts from an empty L1
            http_clear(http)
        started = []
        for p in active:
            err = p.call({"cmd": "begin", "op": op}, timeout)
            if err is None:
                started.append(p)
            else:
                errors.append(f"{p.kind} {op} begin: {err}")
        warmup, reps = op_reps(op, s)
        for i in range(warmup + reps):
            for p in list(started):
                err = p.call({"cmd": "rep", "op": op, "i": i}, timeout)
                if err is not None:
                    errors.append(f"{p.kind} {op} rep {i}: {err}")
                    started.remove(p)
        for p in started:
            err = p.call({"cmd": "end", "op": op}, timeout)
            if err is not None:
                errors.append(f"{p.kind} {op} end: {err}")
        for p in active:
            progress.step(f"{op} ({p.kind})")


@dataclass
class RunResult:
    """Everything a run measured (the report is made from it)."""

    records: dict[Key, dict[str, Any]] = field(default_factory=dict)
    ic: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    infos: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: ``asdict`` of the SHM and pickle :class:`~.servers.Server` (pickle: None).
    servers: dict[str, Any] = field(default_factory=dict)
    steps: list[tuple[str, float]] = field(default_factory=list)


def _base_spec(args: argparse.Namespace, s: Sizes, workloads: Sequence[str],
               threads: Sequence[int], default_threads: int, shm: Server, pick: Server | None
               ) -> dict[str, Any]:
    """What every worker is told (its ``worker`` kind is added per worker)."""
    return {
        "sizes": asdict(s), "threads": list(threads), "default_threads": default_threads,
        "workloads": list(workloads), "seed": 0, "models": shm.models,
        "w3_edit": args.w3_edit, "w3_no_alloc": args.w3_no_alloc,
        "upstream_python": server_python(args),
        "shm": {"url": shm.url, "http_url": shm.http_url, "segment": shm.segment,
                "l1_gib": shm.l1_gib},
        "pickle": None if pick is None else {"url": pick.url, "http_url": pick.http_url,
                                             "l1_gib": pick.l1_gib},
    }


def run(args: argparse.Namespace, s: Sizes, workloads: Sequence[str], *,
        threads: Sequence[int], default_threads: int, workers: Sequence[str],
        with_upstream: bool, timeout: float, notes: list[str]) -> RunResult:
    """Start (or use) the servers, run IC and the workers' ops; stop everything again.

    Args:
        args: The parsed ``bench`` flags (servers, W3 edit, progress).
        s: Sizes.
        workloads: The workloads to run.
        threads: Native copy thread counts.
        default_threads: The copy threads of this SDK's default path.
        workers: The worker kinds to start (``native``, ``torch``, ``upstream``).
        with_upstream: Time upstream's import+connect too.
        timeout: Seconds a worker may take for one step.
        notes: Notes for the report (appended to).
    """
    res = RunResult()
    with contextlib.ExitStack() as stack:
        shm, pick = stack.enter_context(servers(args, s, workloads, notes))
        models = {"w1": s.w1_layers, "w2": s.w2_layers,
                  "w7": (s.w7_layers, s.w7_kv_heads, s.w7_head_dim)}
        register_models(shm, models, stack, args.server_version)
        if pick is not None:
            register_models(pick, models, stack, args.server_version)
        res.servers = {"shm": asdict(shm), "pickle": asdict(pick) if pick else None}
        base_spec = _base_spec(args, s, workloads, threads, default_threads, shm, pick)
        if base_spec["upstream_python"]:
            notes.append(f"servers and the upstream SDK: lmcache {args.server_version} "
                         f"({base_spec['upstream_python']})")
        if pick is not None and pick.models != shm.models:
            notes.append("model names differ between servers")
        ic_kinds = [IC_TORCH, IC_KVF] + ([IC_UP] if with_upstream else [])
        total = sum(len(worker_plan({**base_spec, "worker": w})) for w in workers)
        if "IC" in workloads:
            total += len(ic_kinds) * (s.ic_reps + s.ic_warmup)
        progress = Progress(total, not args.no_progress)
        workdir = Path(tempfile.mkdtemp(prefix="lmckvf-bench-"))
        procs: list[WorkerProc] = []
        try:
            if "IC" in workloads:  # first, while no worker is alive
                http_clear(shm.http_url)
                punch_segment(shm.segment)
                res.ic = run_ic(ic_kinds, shm.url, shm.http_url, shm.models["w1"], s.ic_reps,
                                s.ic_warmup, progress, notes, server_python(args))
            procs = [WorkerProc({**base_spec, "worker": w}, workdir) for w in workers]
            for p in procs:
                if not p.wait_ready(timeout):
                    (notes if p.kind == "upstream" and "not importable" in p.skip_reason
                     else res.errors).append(f"worker {p.kind} not started: {p.skip_reason}")
            server_urls = [shm.http_url] + ([pick.http_url] if pick is not None else [])
            drive(procs, s, server_urls, progress, timeout, res.errors)
        except BaseException:
            for p in procs:  # interrupted: do not wait for a long rep to finish
                p.kill()
            raise
        finally:
            for p in procs:
                data = p.close()
                notes.extend(n for n in data.get("notes", []) if n not in notes)
                res.infos.append(data.get("info", {}))
                for rec in data.get("records", []):
                    res.records[(rec["path"], rec["op"])] = rec
            progress.close()
            with contextlib.suppress(Exception):
                http_clear(shm.http_url)
                punch_segment(shm.segment)
            if not res.errors:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                notes.append(f"worker logs kept in {workdir}")
        res.steps = progress.steps
    return res
