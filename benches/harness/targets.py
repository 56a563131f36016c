"""The targets of issue 4: values, ceilings, verdicts, and whether a run's sizes allow them.

Each workload declares its targets (:class:`~.workloads.TargetSpec`) in
:mod:`.workloads`; :func:`compute_targets` measures them in ``TARGET_ORDER``.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .names import kvf_native, roofline
from .sizes import Sizes
from .stats import Key, Row, fmt, roofline_ref, speedup, time_ratio
from .workloads import OPTIONAL_WORKLOADS, TARGET_ORDER, TargetSpec, workload


@dataclass
class Target:
    """One target of issue 4 and its measured value."""

    name: str
    value: float | None
    best: float | None
    cmp: str
    threshold: float
    detail: str = ""
    #: The value a client whose own work cost nothing would reach in this run: only the
    #: server's replies (this SDK's measured waits: round trips + server processing) plus a
    #: flat memcpy of the bytes (the roofline). None where no such floor is defined.
    ceiling: float | None = None

    def _meets(self, v: float) -> bool:
        return v >= self.threshold if self.cmp == ">=" else v <= self.threshold

    @property
    def status(self) -> str:
        """PASS / MISS (on the median-based value), info (no threshold) or n/a."""
        if self.value is None or not math.isfinite(self.value):
            return "n/a"
        if not self.cmp:
            return "info"
        return "PASS" if self._meets(self.value) else "MISS"

    @property
    def reachable(self) -> bool | None:
        """False when a missed target's ceiling misses it too (None: no ceiling).

        The ceiling comes from medians and the value may be paired per rep, so a passed
        target can sit a little above its ceiling: it is reachable all the same.
        """
        if self.ceiling is None or not math.isfinite(self.ceiling):
            return None
        return self.status == "PASS" or self._meets(self.ceiling)


def floor_s(records: dict[Key, dict[str, Any]], path: str, op: str,
            default_threads: int) -> float | None:
    """Fastest ``op`` could run for a client whose own work is free, in this run.

    The median time ``path``'s calls spent blocked on server replies (``last_timing``
    waits: every RPC it made, round trips + the server's processing) plus the median of
    the flat memcpy roofline of the same bytes (or of the call's own chunk copy, when that
    ran faster). None without phases or roofline.
    """
    rec = records.get((path, op))
    phases = rec.get("phases") if rec else None
    ref = roofline_ref(path, op, default_threads)
    roof = records.get(ref) if ref else None
    if not rec or not phases or not roof or not roof["samples"]:
        return None
    roof_s = statistics.median(samples_during(roof, driven_op(rec)))
    copy = min(roof_s, statistics.median(ph["copy_s"] for ph in phases))
    return statistics.median(ph["wait_s"] for ph in phases) + copy


def driven_op(rec: dict[str, Any]) -> str | None:
    """The one driven op all of a record's samples were taken in (None: several/unknown)."""
    during = set(rec.get("during") or [])
    return next(iter(during)) if len(during) == 1 else None


def samples_during(rec: dict[str, Any], during: str | None) -> list[float]:
    """A record's samples taken while ``during`` was driven (all of them if none were).

    The roofline copy is timed in every W1 op; a ceiling next to a paired target must use
    the copies timed in the same reps, like the target's value does.
    """
    xs = [x for x, d in zip(rec["samples"], rec.get("during") or [], strict=False)
          if during is not None and d == during]
    return xs or list(rec["samples"])


def target_specs(ops_run: set[str] | None = None) -> list[TargetSpec]:
    """Every workload's targets, in the order of the targets section.

    With ``ops_run`` (the ops that have records), an optional workload's targets (one
    run only when named, such as W7) are left out when none of its ops ran.
    """
    return [t for name in TARGET_ORDER for t in workload(name).targets
            if ops_run is None or name not in OPTIONAL_WORKLOADS
            or ops_run & set(workload(name).ops)]


Pair = tuple[float | None, float | None]


def _measure(spec: TargetSpec, a: Key, b: Key, rows: dict[Key, Row],
             records: dict[Key, dict[str, Any]], ic: dict[str, dict[str, list[float]]],
             default_threads: int) -> tuple[Pair, str, float | None]:
    """``((value, best), method, ceiling)`` of one target."""
    if spec.measure == "speed":
        ceiling = None
        if spec.ceiling:  # "a is x times faster than b" (b: a roofline copy or another SDK)
            ra = records.get(a)
            fl = floor_s(records, *a, default_threads)
            rb = records.get(b)
            during = driven_op(ra) if ra else None
            tb = statistics.median(samples_during(rb, during)) if rb and rb["samples"] \
                else None
            ceiling = tb / fl if fl and tb else None
        v, best, how = speedup(records, a, b)
        return (v, best), how, ceiling
    if spec.measure == "time":  # a's time over b's (lower is better)
        v, best, how = time_ratio(records, a, b)
        return (v, best), how, None
    if spec.measure in ("growth", "rss_growth"):  # memory growth over one sequence's bytes
        rec = records.get(a) or {}
        field = "private_growth" if spec.measure == "growth" else "rss_anon_growth"
        xs, per = rec.get(field) or [], rec.get("seq_bytes") or 0
        if not xs or not per:
            return (None, None), "max", None
        return (max(xs) / per, min(xs) / per), "max", None
    if spec.measure == "p50":  # p50 of a over p50 of b (latency: lower is better)
        ceiling = None
        row_a, row_b = rows.get(a), rows.get(b)
        if spec.ceiling:
            fl = floor_s(records, *a, default_threads)
            ceiling = fl / row_b.median if fl and row_b and row_b.median > 0 else None
        if row_a is None or row_b is None:
            return (None, None), "p50s", ceiling
        return (row_a.median / row_b.median, row_a.min / row_b.min), "p50s", ceiling
    ours = ic.get(a[0], {})
    if spec.measure == "ic_total":  # import + connect, this SDK over upstream
        other = ic.get(b[0], {})
        if ours.get("total") and other.get("total"):
            return (statistics.median(ours["total"]) / statistics.median(other["total"]),
                    min(ours["total"]) / min(other["total"])), "", None
        return (None, None), "", None
    if spec.measure == "ic_own":  # this SDK's import + connect beyond import torch
        if ours.get("own"):
            return (statistics.median(ours["own"]), min(ours["own"])), "", None
        return (None, None), "", None
    raise ValueError(f"target {spec.name!r}: unknown measure {spec.measure!r}")


def compute_targets(rows: dict[Key, Row], records: dict[Key, dict[str, Any]],
                    ic: dict[str, dict[str, list[float]]], default_threads: int) -> list[Target]:
    """Every target of issue 4 from one run (see :func:`speedup`; ``best``: of minima)."""
    names = {"ours": kvf_native(default_threads), "roof": roofline(default_threads)}
    out: list[Target] = []
    for spec in target_specs({op for (_path, op) in records}):
        a = (spec.a[0].format(**names), spec.a[1])
        b = (spec.b[0].format(**names), spec.b[1])
        vals, how, ceiling = _measure(spec, a, b, rows, records, ic, default_threads)
        detail = f"{spec.detail.format(**names)} {how}".strip()
        out.append(Target(spec.name, vals[0], vals[1], spec.cmp, spec.threshold, detail,
                          ceiling))
    return out


def reduced_sizes(s: Sizes) -> list[str]:
    """How ``s`` falls short of the issue's sizes (empty: a run the targets apply to).

    Larger sizes or more repetitions still measure what the targets mean; fewer do not
    (a 1-rep W3 of 3 short sequences is all fixed costs), nor does another chunk size
    (W2 is one 256-token chunk).
    """
    ref = Sizes()
    out = [f"chunk {s.chunk} != {ref.chunk}"] if s.chunk != ref.chunk else []
    return out + [f"{f.name} {getattr(s, f.name)} < {getattr(ref, f.name)}"
                  for f in fields(Sizes)
                  if f.name != "chunk" and getattr(s, f.name) < getattr(ref, f.name)]


def print_targets(targets: Sequence[Target], out: Any = None,
                  reduced: Sequence[str] = ()) -> None:
    """Print the targets section.

    Args:
        targets: The evaluated targets.
        out: Stream (stdout when None).
        reduced: :func:`reduced_sizes` of the run: when any, the verdicts are marked as
            indicative (the targets are defined on the issue's sizes).
    """
    out = out or sys.stdout
    growth = any(tg.detail.endswith(" max") or tg.detail == "max" for tg in targets)
    print("\ntargets (value: median of per-rep ratios when both sides ran in the same reps "
          "(paired), else ratio of medians; [ratio of minima]"
          + ("; growth: the largest of the runs [the smallest]; info: no verdict"
             if growth else "") + ")", file=out)
    if reduced:
        print("INDICATIVE ONLY: this run's sizes are below the ones the targets are defined on "
              f"({', '.join(reduced[:4])}{', ...' if len(reduced) > 4 else ''}); run "
              "`lmcache-kv-fast bench` without --quick (~5 minutes) for the verdicts", file=out)
    print("-" * 124, file=out)
    for tg in targets:
        val = f"{fmt(tg.value, '.3f'):>7s} [{fmt(tg.best, '.3f'):>6s}]"
        how = tg.detail.rsplit(" ", 1)[-1] if tg.detail else ""
        ceil = f"ceiling {fmt(tg.ceiling, '.3f'):>6s}" if tg.ceiling is not None else ""
        bound = f"{tg.cmp} {tg.threshold:<4g}" if tg.cmp else f"{'':7s}"
        print(f"{tg.status:5s} {tg.name:62s} {val} {bound} {how:8s} {ceil}", file=out)
    n_pass = sum(tg.status == "PASS" for tg in targets)
    n_miss = sum(tg.status == "MISS" for tg in targets)
    n_info = sum(tg.status == "info" for tg in targets)
    beyond = sum(tg.status == "MISS" and tg.reachable is False for tg in targets)
    print(f"{n_pass} PASS, {n_miss} MISS ({beyond} of them beyond their ceiling), "
          + (f"{n_info} info, " if n_info else "")
          + f"{len(targets) - n_pass - n_miss - n_info} n/a"
          + (" -- indicative only (reduced sizes, see above)" if reduced else ""), file=out)
    print("ceiling: the value this run allows a client whose own work is free, from medians: "
          "only the server's replies (this SDK's waits: round trips + server processing) plus "
          "a flat memcpy of the same bytes; a target beyond its ceiling cannot be met against "
          "this server on this machine (cold stores, import and W3 have no such floor)",
          file=out)
