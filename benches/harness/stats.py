"""Rows of the table (statistics of one path x op) and their ratios to roofline and upstream."""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .names import KVF_PICKLE, KVF_T1, UPSTREAM, UPSTREAM_PICKLE, UPSTREAM_T1, roofline
from .workloads import ROOF_OP, UPSTREAM_OP

#: What a run's records are keyed by: (path, op).
Key = tuple[str, str]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of ``values`` (non-empty)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def fmt(x: float | None, spec: str = ".2f", none: str = "-") -> str:
    """``x`` formatted by ``spec`` (``none`` for None or a non-finite value)."""
    return none if x is None or not math.isfinite(x) else format(x, spec)


@dataclass
class Row:
    """Statistics of one (path, op) over its samples (seconds)."""

    path: str
    op: str
    n: int
    nbytes: int
    min: float
    median: float
    p90: float
    p99: float
    failures: int = 0
    x_roofline: float | None = None
    x_upstream: float | None = None
    note: str = ""

    @property
    def gbps(self) -> float:
        """GB/s at the median."""
        return self.nbytes / self.median / 1e9 if self.median > 0 else 0.0


def rows_of(records: dict[Key, dict[str, Any]]) -> dict[Key, Row]:
    """One :class:`Row` per record with samples (ratios not filled: :func:`add_ratios`)."""
    rows: dict[Key, Row] = {}
    for key, rec in records.items():
        xs = [float(x) for x in rec["samples"]]
        if not xs:
            continue
        rows[key] = Row(rec["path"], rec["op"], len(xs), int(rec["nbytes"]), min(xs),
                        statistics.median(xs), percentile(xs, 90), percentile(xs, 99),
                        int(rec.get("failures", 0)), note=rec.get("note", ""))
    return rows


def threads_of(path: str) -> int | None:
    """The copy threads a ``...-<k>t`` path name ends with (None: none)."""
    if path.endswith("t") and "-" in path:
        with contextlib.suppress(ValueError):
            return int(path.rsplit("-", 1)[1][:-1])
    return None


def upstream_ref(path: str, op: str) -> Key | None:
    """The upstream (path, op) a row compares against (None for none)."""
    if path.startswith("roofline") or path.startswith("upstream"):
        return None
    up = UPSTREAM_PICKLE if path == KVF_PICKLE else UPSTREAM_T1 if path == KVF_T1 else UPSTREAM
    return up, UPSTREAM_OP.get(op, op)


def roofline_ref(path: str, op: str, default_threads: int) -> Key | None:
    """The roofline (path, op) a row compares against (None for none)."""
    if path.startswith("roofline"):
        return None
    ref_op = ROOF_OP.get(op)
    if ref_op is None:
        return None
    k = threads_of(path) if path.startswith("kvfast-native-") else None
    return roofline(k or default_threads), ref_op


def _by_rep(rec: dict[str, Any], during: str) -> dict[int, float]:
    return {r: x for x, r, d in zip(rec["samples"], rec.get("reps", []), rec.get("during", []))
            if d == during and r is not None}


def speedup(records: dict[Key, dict[str, Any]], a: Key, b: Key
            ) -> tuple[float | None, float | None, str]:
    """How many times faster ``a`` is than ``b``: ``(value, ratio of minima, method)``.

    ``value`` is the median over reps of ``b_i / a_i`` when both were timed in the same
    driven op (same rep = the same few seconds, so load bursts cancel: "paired"), else the
    ratio of medians ("medians").
    """
    ra, rb = records.get(a), records.get(b)
    if not ra or not rb or not ra["samples"] or not rb["samples"]:
        return None, None, ""
    best = min(rb["samples"]) / min(ra["samples"])
    for during in dict.fromkeys(ra.get("during", [])):
        if during is None:
            continue
        pa, pb = _by_rep(ra, during), _by_rep(rb, during)
        common = sorted(set(pa) & set(pb))
        if len(common) >= max(1, min(len(pa), len(pb)) // 2) and len(set(ra["during"])) == 1:
            return statistics.median(pb[i] / pa[i] for i in common), best, "paired"
    return statistics.median(rb["samples"]) / statistics.median(ra["samples"]), best, "medians"


def time_ratio(records: dict[Key, dict[str, Any]], a: Key, b: Key
               ) -> tuple[float | None, float | None, str]:
    """``a``'s time over ``b``'s: ``(value, ratio of minima, method)``.

    Paired like :func:`speedup` (the median over reps of ``a_i / b_i`` when both were timed
    in the same driven op), else the ratio of medians.
    """
    ra, rb = records.get(a), records.get(b)
    if not ra or not rb or not ra["samples"] or not rb["samples"]:
        return None, None, ""
    best = min(ra["samples"]) / min(rb["samples"])
    during = set(ra.get("during") or [])
    if len(during) == 1 and None not in during:
        pa, pb = _by_rep(ra, *during), _by_rep(rb, *during)
        common = sorted(set(pa) & set(pb))
        if len(common) >= max(1, min(len(pa), len(pb)) // 2):
            return statistics.median(pa[i] / pb[i] for i in common), best, "paired"
    return statistics.median(ra["samples"]) / statistics.median(rb["samples"]), best, "medians"


def add_ratios(rows: dict[Key, Row], records: dict[Key, dict[str, Any]],
               default_threads: int) -> None:
    """Fill each row's ratio to its roofline (fraction) and to upstream (speed-up)."""
    for (path, op), row in rows.items():
        ref = roofline_ref(path, op, default_threads)
        if ref is not None and ref not in rows:
            ref = (roofline(default_threads), ref[1])
        if ref is not None and ref in rows:
            row.x_roofline = speedup(records, (path, op), ref)[0]
        up = upstream_ref(path, op)
        if up is not None and up in rows:
            row.x_upstream = speedup(records, (path, op), up)[0]
