"""The batch benches run end to end at tiny sizes and print their rows (numbers not judged)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])}
    env.pop("LMCACHE_KV_FAST_BACKEND", None)
    p = subprocess.run([sys.executable, str(ROOT / "benches" / name), *args],
                       capture_output=True, text=True, timeout=timeout, env=env,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


@pytest.mark.timeout(300)
def test_bench_batch_plain_runs_every_path_verified() -> None:
    p = _run("bench_batch_plain.py", "--sequences", "2", "--tokens", "512", "--layers", "2",
             "--reps", "1", "--l1-gb", "0.25", "--paths", "rewrite,loop,upstream,rewrite-alloc",
             "--variant", "nopool:pool_outputs=false")
    assert "rep 0 (warm-up, verified)" in p.stdout
    rows = {ln.split()[0]: ln.split() for ln in p.stdout.splitlines()
            if ln[:1].strip() and ln.split()[0] in ("rewrite", "loop", "upstream", "rewrite-alloc",
                                                "rewrite:nopool")}
    skipped_upstream = "upstream skipped" in p.stdout
    assert set(rows) >= {"rewrite", "loop", "rewrite-alloc", "rewrite:nopool"}
    assert skipped_upstream or "upstream" in rows
    for r in rows.values():
        assert math.isfinite(float(r[1])) and float(r[1]) > 0, r
    assert "rewrite vs loop:" in p.stdout


@pytest.mark.timeout(300)
def test_bench_edit_alloc_runs() -> None:
    p = _run("bench_edit_alloc.py", "--variants", "plain,pooled", "--where", "main,worker",
             "--threads", "1", "--calls", "3", "--layers", "2", "--tokens", "2048")
    rows = [ln.split() for ln in p.stdout.splitlines()
            if ln.split() and ln.split()[0] in ("plain", "pooled")]
    assert len(rows) == 4, p.stdout
    pooled = [r for r in rows if r[0] == "pooled"]
    assert all(float(r[-3]) < 100 for r in pooled), p.stdout  # no fault per page of output
