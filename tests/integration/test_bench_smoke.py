"""Smoke test of the benchmark harness: ``bench --quick --json`` against its own servers.

Checks that every path and workload produced positive, finite numbers; no timing assertions.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_kv_fast.testing.server import lmcache_available

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(not lmcache_available(), reason="needs the LMCache server (lmcache)"),
    pytest.mark.skipif(
        os.environ.get("LMCACHE_KV_FAST_BACKEND", "").strip().lower() == "torch",
        reason="the bench runs each backend in its own worker; once per suite is enough",
    ),
]


@pytest.mark.parametrize("tokens", [1, 9, 10, 25, 260, 2048])
def test_w3_edit_matches_demo(tokens: int) -> None:
    import torch

    from benches.harness import cli, edits, helpers, names, report, sizes, stats  # noqa: F401
    from benches.harness import targets as bt  # noqa: F401
    from lmcache_kv_fast.demo import drop_every_kth

    kv = torch.randn(2, 3, tokens, 8).to(torch.bfloat16)
    toks = list(range(100, 100 + tokens))
    want_kv, want_toks = drop_every_kth(kv, toks, 10)
    for fn in (edits.drop_every_kth, edits.drop_every_kth_index_select,
               edits.drop_every_kth_plain):
        got_kv, got_toks = fn(kv, toks, 10)
        assert torch.equal(got_kv, want_kv) and got_toks == want_toks
        assert got_kv.is_contiguous()
    # W3P's edit is the plain function: two arguments, no alloc for rewrite to use
    from lmcache_kv_fast.batch._workers import accepts_alloc

    assert not accepts_alloc(edits.drop_every_kth_plain)


def test_target_ceiling_from_waits_and_roofline() -> None:
    """The ceiling of a target: the other side's median over (server waits + flat copy)."""
    from benches.harness import cli, edits, helpers, names, report, sizes, stats  # noqa: F401
    from benches.harness import targets as bt

    ours, roof = names.kvf_native(2), names.roofline(2)

    def rec(path: str, op: str, xs: list[float], phases: list[dict] | None = None) -> dict:
        return {"path": path, "op": op, "nbytes": 1 << 29, "samples": xs, "reps": [],
                "during": [], "phases": phases or []}

    ph = [{"wait_s": 0.005, "copy_s": c, "total_s": 0.04, "alloc_s": 0.0, "client_s": 0.001,
           "rpcs": 2, "chunks": 16} for c in (0.031, 0.032, 0.033)]
    records = {
        (ours, names.W1_STORE_WARM): rec(ours, names.W1_STORE_WARM, [0.039, 0.040, 0.041], ph),
        (names.UPSTREAM, names.W1_STORE_WARM): rec(names.UPSTREAM, names.W1_STORE_WARM, [0.06, 0.07, 0.08]),
        (roof, names.W1_COPY_WARM): rec(roof, names.W1_COPY_WARM, [0.029, 0.030, 0.031]),
        (ours, names.W1_STORE_COLD): rec(ours, names.W1_STORE_COLD, [0.2], ph),
        (names.UPSTREAM, names.W1_STORE_COLD): rec(names.UPSTREAM, names.W1_STORE_COLD, [0.25]),
    }
    # the copy floor is the faster of the roofline (30 ms) and the call's own copy (32 ms)
    assert bt.floor_s(records, ours, names.W1_STORE_WARM, 2) == pytest.approx(0.035)
    assert bt.floor_s(records, names.UPSTREAM, names.W1_STORE_WARM, 2) is None  # no phases
    targets = {t.name: t for t in bt.compute_targets(stats.rows_of(records), records, {}, 2)}
    t = targets["W1 store warm vs roofline"]
    assert t.ceiling == pytest.approx(0.030 / 0.035) and t.status == "MISS"
    assert t.reachable is False  # 0.857 < 0.9: out of reach against this "server"
    t = targets["W1 store warm vs upstream"]
    assert t.ceiling == pytest.approx(0.070 / 0.035) and t.status == "PASS" and t.reachable
    assert targets["W1 store cold vs upstream"].ceiling is None
    assert targets["W1 store cold vs upstream"].reachable is None
    assert targets["W4 pickle plane store vs upstream"].status == "n/a"

    # paired: the roofline copies timed in the store's own reps set its ceiling, like its value
    store = records[(ours, names.W1_STORE_WARM)]
    store["during"], store["reps"] = [names.W1_STORE_WARM] * 3, [0, 1, 2]
    records[(roof, names.W1_COPY_WARM)] = {
        **rec(roof, names.W1_COPY_WARM, [0.029, 0.030, 0.031, 0.020, 0.020, 0.020]),
        "during": [names.W1_STORE_WARM] * 3 + [names.W1_RET_WARM] * 3, "reps": [0, 1, 2, 0, 1, 2]}
    assert bt.samples_during(records[(roof, names.W1_COPY_WARM)], names.W1_RET_WARM) == [0.02] * 3
    assert bt.samples_during(records[(roof, names.W1_COPY_WARM)], "W9") == \
        records[(roof, names.W1_COPY_WARM)]["samples"]
    assert bt.floor_s(records, ours, names.W1_STORE_WARM, 2) == pytest.approx(0.035)
    targets = {t.name: t for t in bt.compute_targets(stats.rows_of(records), records, {}, 2)}
    t = targets["W1 store warm vs roofline"]
    assert t.value == pytest.approx(0.030 / 0.040) and t.detail.endswith("paired")
    assert t.ceiling == pytest.approx(0.030 / 0.035)  # not the all-ops median 0.0245


def test_phase_split_of_waits_by_ping() -> None:
    """waits = rpcs x the op's median ping (per server) + the server's own share."""
    from benches.harness import cli, edits, helpers, names, report, sizes, stats  # noqa: F401
    from benches.harness import targets as bt  # noqa: F401

    ours, roof = names.kvf_native(2), names.roofline(2)
    ph = [{"wait_s": w, "copy_s": 0.02, "total_s": 0.03, "alloc_s": 0.0, "client_s": 0.001,
           "rpcs": 3, "chunks": 16} for w in (0.004, 0.005, 0.006)]
    pick = [{**x, "wait_s": 0.0001} for x in ph]
    ph[1]["hinted"] = ph[2]["hinted"] = 8  # the first rep had no hint yet
    ph[2]["rehinted"] = 2
    records = {
        (ours, names.W1_RET_WARM): {"path": ours, "op": names.W1_RET_WARM, "samples": [0.03] * 3,
                                "phases": ph},
        (roof, names.W1_COPY_WARM): {"path": roof, "op": names.W1_COPY_WARM, "samples": [0.02] * 3,
                                 "phases": []},
        (names.KVF_PICKLE, names.W4_RET): {"path": names.KVF_PICKLE, "op": names.W4_RET,
                                   "samples": [0.1] * 3, "phases": pick},
    }
    infos = [{"worker": "native", "ping_s": {"shm": {names.W1_RET_WARM: [0.0002, 0.0003]},
                                            "pickle": {names.W4_RET: [0.001]}}},
             {"worker": "torch", "ping_s": {"shm": {names.W1_RET_WARM: [0.0004]}}},
             {"worker": "upstream"}]
    pings = report.merge_pings(infos)
    assert pings == {"shm": {names.W1_RET_WARM: [0.0002, 0.0003, 0.0004]},
                     "pickle": {names.W4_RET: [0.001]}}
    rows = {(r["path"], r["op"]): r for r in report.phase_summary(records, 2, pings)}
    r = rows[(ours, names.W1_RET_WARM)]
    # 3 rpcs, of which 2 in 3 calls' prepare_retrieve replies came during early copies
    assert r["ping_s"] == pytest.approx(0.0003) and r["rtt_s"] == pytest.approx(0.0007)
    assert r["server_s"] == pytest.approx(0.005 - 0.0007)
    assert r["early_calls"] == pytest.approx(2 / 3)
    assert r["copy_x_roof"] == pytest.approx(1.0)
    assert r["hinted_share"] == pytest.approx(16 / 48)
    buf = io.StringIO()
    report.print_phases(list(rows.values()), 2, out=buf)
    assert " 33%" in buf.getvalue() and "hinted" in buf.getvalue()
    r = rows[(names.KVF_PICKLE, names.W4_RET)]  # its own server's ping; never negative
    assert r["rtt_s"] == pytest.approx(0.003) and r["server_s"] == 0.0
    r = report.phase_summary(records, 2)[0]  # no pings: no split
    assert r["ping_s"] is None and r["rtt_s"] is None and r["server_s"] is None


def _bench_env() -> dict[str, str]:
    """The environment of a bench subprocess: this checkout first on the path, default backend."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])}
    env.pop("LMCACHE_KV_FAST_BACKEND", None)
    return env


def _positive(xs: list[float]) -> bool:
    return bool(xs) and all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in xs)


@pytest.mark.timeout(360)
def test_bench_quick_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = _bench_env()
    p = subprocess.run(
        [sys.executable, "-m", "lmcache_kv_fast", "bench", "--quick", "--no-progress",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    assert "targets" in p.stdout and "W1 store warm" in p.stdout
    doc = json.loads(out.read_text())

    for key in ("cores", "memory_gib", "python", "torch", "lmcache", "lmcache_kv_fast"):
        assert doc["machine"].get(key), key
    assert doc["machine"]["default_backend"] == "native"
    for srv in ("shm", "pickle"):  # servers started with docs/deployment.md's allocator settings
        assert doc["servers"][srv]["malloc"]["MALLOC_ARENA_MAX"] == "1", doc["servers"]
    assert "started servers' allocator: MALLOC_ARENA_MAX=1" in p.stdout
    assert not doc["errors"]

    n = doc["default_threads"]
    native = [f"kvfast-native-{k}t" for k in doc["threads"]]
    roof = sorted({f"roofline-{k}t" for k in (1, n)})
    ours_shm = [*native, "kvfast-native@torch1", "kvfast-torch"]
    ups_shm = ["upstream", "upstream@torch1"]
    expected: dict[str, list[str]] = {
        "W1 store warm": ours_shm + ups_shm,
        "W1 store cold": ours_shm + ups_shm,
        "W1 retrieve warm": ours_shm + ups_shm,
        "W1 retrieve cold": ours_shm + ups_shm,
        "W1 retrieve+out warm": ours_shm,
        "W1 copy warm": roof,
        "W1 copy cold": roof,
        "W1 copy cold shm": roof,
        "W2 store": [*ours_shm, *ups_shm, "kvfast-pickle", "upstream-pickle"],
        "W2 retrieve": [*ours_shm, *ups_shm, "kvfast-pickle", "upstream-pickle"],
        "W2 copy": roof,
        "W3 rewrite sequential": [f"kvfast-native-{n}t", "upstream"],
        "W3 rewrite batch": [f"kvfast-native-{n}t"],
        "W3P loop (plain fn)": [f"kvfast-native-{n}t", "upstream"],
        "W3P batch (plain fn)": [f"kvfast-native-{n}t"],
        "W4 store": ["kvfast-pickle", "upstream-pickle"],
        "W4 retrieve": ["kvfast-pickle", "upstream-pickle"],
        "W4 copy": roof,
    }
    records = {(r["path"], r["op"]): r for r in doc["records"]}
    for op, paths in expected.items():
        for path in paths:
            rec = records.get((path, op))
            assert rec is not None, f"no record for {path} / {op}"
            assert rec["nbytes"] > 0, (path, op)
            assert _positive(rec["samples"]), (path, op, rec)
    # upstream's drop-in retrieve is also timed in the retrieve+out reps (its reference there)
    up_ret = records[("upstream", "W1 retrieve warm")]
    assert set(up_ret["during"]) == {"W1 retrieve warm", "W1 retrieve+out warm"}
    assert ("upstream", "W1 retrieve+out warm") not in records
    summary = {(r["path"], r["op"]): r for r in doc["summary"]}
    for key, row in summary.items():
        for f in ("min", "median", "p90", "p99", "gbps"):
            assert math.isfinite(row[f]) and row[f] > 0, (key, f, row[f])

    # where the time goes: this SDK's calls carry their ctx.last_timing, upstream's none
    phases = {(p["path"], p["op"]): p for p in doc["phases"]}
    for op in ("W1 store warm", "W1 retrieve warm", "W1 retrieve+out warm", "W2 store",
               "W2 retrieve"):
        ph = phases[(f"kvfast-native-{n}t", op)]
        assert ph["n"] == len(records[(f"kvfast-native-{n}t", op)]["samples"])
        assert ph["rpcs"] >= 2 and ph["chunks"] >= 1, ph
        for f in ("total_s", "wait_s", "copy_s", "copy_x_roof", "ping_s", "rtt_s"):
            assert math.isfinite(ph[f]) and ph[f] > 0, (op, f, ph)
        assert ph["server_s"] == pytest.approx(max(0.0, ph["wait_s"] - ph["rtt_s"]))
        for one in records[(f"kvfast-native-{n}t", op)]["phases"]:
            assert one["op"] in ("store", "retrieve") and one["client_s"] >= 0
            assert one["wait_s"] + one["copy_s"] <= one["total_s"]
    assert ("kvfast-pickle", "W4 store") in phases
    assert not any(p.startswith("upstream") for (p, _o) in phases)
    assert "where the time goes" in p.stdout and "server ms" in p.stdout

    ic = doc["import_connect"]["samples"]
    for kind in ("import torch", "kvfast import+connect", "upstream import+connect"):
        assert _positive(ic[kind]["import"]), kind
        assert _positive(ic[kind]["total"]), kind
    for kind in ("kvfast import+connect", "upstream import+connect"):
        assert _positive(ic[kind]["connect"]), kind

    targets = {t["name"]: t for t in doc["targets"]}
    assert len(targets) == 18
    # W3P: the plain edit, rewrite paired with both loops in the same reps
    for name in ("W3P plain fn: batch.rewrite vs upstream loop",
                 "W3P plain fn: batch.rewrite vs own loop"):
        assert targets[name]["detail"].endswith("paired"), targets[name]
    assert "W3P plain fn: batch.rewrite vs own loop" in p.stdout
    assert targets["W1 retrieve warm, with out vs upstream"]["detail"].endswith("paired")
    for t in targets.values():
        assert t["status"] in ("PASS", "MISS"), t
        assert math.isfinite(t["value"]), t
    # every SDK-vs-SDK / vs-roofline target of the SHM and pickle planes has a ceiling
    # (server waits + flat memcpy); cold stores, import and W3 have none
    with_ceiling = [n for n, t in targets.items() if t["ceiling"] is not None]
    assert len(with_ceiling) == 11, with_ceiling
    for n in with_ceiling:
        assert math.isfinite(targets[n]["ceiling"]) and targets[n]["ceiling"] > 0, targets[n]
        assert targets[n]["reachable"] in (True, False), targets[n]
    assert targets["W1 store cold vs upstream"]["reachable"] is None
    assert "ceiling" in p.stdout and "beyond their ceiling" in p.stdout
    # a --quick run says its verdicts are indicative: the targets are defined on full sizes
    assert doc["targets_indicative"] is True and "w1_tokens 1024 < 4096" in doc["reduced_sizes"]
    assert "INDICATIVE ONLY" in p.stdout and "indicative only (reduced sizes" in p.stdout


def test_reduced_sizes_mark_the_verdicts_indicative() -> None:
    """Only a run at (or above) the issue's sizes gives verdicts; smaller runs say so."""
    from benches.harness import cli, edits, helpers, names, report, sizes, stats  # noqa: F401
    from benches.harness import targets as bt

    assert bt.reduced_sizes(sizes.Sizes()) == []
    assert bt.reduced_sizes(sizes.Sizes(reps=20, w2_ops=1000)) == []  # more is still the target
    quick = bt.reduced_sizes(sizes.Sizes(**sizes.QUICK))
    assert "w3_sequences 3 < 16" in quick and "reps 3 < 7" in quick
    assert bt.reduced_sizes(sizes.Sizes(chunk=128)) == ["chunk 128 != 256"]

    tg = [bt.Target("W1 store warm vs roofline", 0.5, 0.5, ">=", 0.9)]
    full, small = io.StringIO(), io.StringIO()
    bt.print_targets(tg, full)
    bt.print_targets(tg, small, reduced=quick)
    assert "INDICATIVE" not in full.getvalue() and "1 MISS" in full.getvalue()
    assert "INDICATIVE ONLY" in small.getvalue() and "w1_tokens 1024 < 4096" in small.getvalue()
    assert "indicative only (reduced sizes" in small.getvalue().splitlines()[-2]


def _run_bench_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``benches/<name>`` (this checkout on the path, the default backend); assert rc 0."""
    env = _bench_env()
    p = subprocess.run(
        [sys.executable, str(ROOT / "benches" / name), *args],
        capture_output=True, text=True, timeout=100, env=env, stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return p


@pytest.mark.timeout(120)
def test_bench_read_hints_runs() -> None:
    """benches/bench_read_hints.py (hinted / plain / stale side by side) runs and prints rows."""
    p = _run_bench_script("bench_read_hints.py", "--reps", "3", "--sizes", "w2")
    rows = [ln.split() for ln in p.stderr.splitlines() if ln.startswith("w2 ")]
    assert {(r[1], r[2]) for r in rows} == {(pat, call) for pat in ("separated", "back-to-back")
                                            for call in ("drop-in", "out")}
    for r in rows:  # hinted, plain, stale, memcpy ms and the ratios: positive, finite
        assert all(math.isfinite(float(x)) and float(x) > 0 for x in r[3:10]), r


@pytest.mark.timeout(120)
def test_bench_store_limits_runs() -> None:
    """benches/bench_store_limits.py (plain / pipelined / prewarmed stores) runs and prints rows."""
    p = _run_bench_script("bench_store_limits.py", "--reps", "2", "--layers", "2",
                          "--splits", "1,8")
    rows = {ln.split()[0]: ln.split() for ln in p.stderr.splitlines()
            if ln.split() and ln.split()[0] in ("plain", "split-1", "split-8", "prewarm")}
    assert set(rows) == {"plain", "split-1", "split-8", "prewarm"}, p.stderr[-2000:]
    for r in rows.values():  # median ms, x plain, x roof, waits ms: positive, finite
        assert all(math.isfinite(float(x)) and float(x) > 0 for x in r[1:5]), r
    assert 0 < float(rows["plain"][5]) <= 1, rows["plain"]  # the ceiling is a fraction
    assert "right after the roofline copy" in p.stderr


@pytest.mark.timeout(360)
@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_bench_against_057_and_its_own_sdk(tmp_path: Path, transport: str) -> None:
    from testbed.compat import missing_venv_hint, venv_python

    if venv_python("0.5.7rc2") is None:
        pytest.skip(missing_venv_hint("0.5.7rc2"))
    out = tmp_path / "bench057.json"
    # the rewrite workloads once (over gRPC): the zmq dialect's are the 0.5.7rc2 test pass's
    loads = "W1,W3,W3P" if transport == "grpc" else "W1"
    p = subprocess.run(
        [sys.executable, "-m", "lmcache_kv_fast", "bench", "--quick", "--no-progress",
         "--server-version", "0.5.7rc2", "--workloads", loads, "--threads", "2",
         "--no-torch-backend", "--transport", transport, "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=_bench_env(), cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert not doc["errors"]
    assert doc["servers"]["shm"]["version"].startswith("0.5.7rc2")
    assert doc["servers"]["shm"]["url"].startswith("grpc://" if transport == "grpc" else "tcp://")
    assert "servers and the upstream SDK: lmcache 0.5.7rc2" in p.stdout
    records = {(r["path"], r["op"]): r for r in doc["records"]}
    ops = ["W1 store warm", "W1 retrieve warm"]
    if transport == "grpc":
        ops.append("W3 rewrite sequential")
        assert _positive(records[("kvfast-native-2t", "W3P batch (plain fn)")]["samples"])
    for op in ops:
        for path in ("upstream", "kvfast-native-2t"):  # 0.5.7rc2's own SDK ran too
            assert _positive(records[(path, op)]["samples"]), (path, op)


def test_w7_plain_edit_selects_what_the_library_edit_selects() -> None:
    """W7's plain-torch SnapKV + re-rotation (upstream's loop) is the library edit's twin."""
    import torch

    from benches.harness import edits as bedits
    from lmcache_kv_fast import edits

    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(2, 3, 300, 2 * 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, 40, 8 * 64, generator=gen).to(torch.bfloat16)
    toks = list(range(1000, 1300))
    r = bedits.LLAMA32_1B_ROPE
    rope = edits.rope_from_config({"model_type": "llama", "head_dim": 64,
                                   "rope_theta": r["rope_theta"],
                                   "rope_scaling": {"rope_type": "llama3", "factor": r["factor"],
                                                    "low_freq_factor": r["low_freq_factor"],
                                                    "high_freq_factor": r["high_freq_factor"],
                                                    "original_max_position_embeddings":
                                                        r["original_max_position_embeddings"]}})
    torch.testing.assert_close(bedits.llama3_inv_freq(r), rope.inv_freq())
    want_kv, want_toks = edits.snapkv(q, 32, 7, ratio=0.5, rope=rope)(kv, toks)
    got_kv, got_toks = bedits.snapkv_rerotate_plain(kv, toks, q, bedits.llama3_inv_freq(r))
    assert got_toks == want_toks and len(got_toks) == 150
    torch.testing.assert_close(got_kv.float(), want_kv.float(), rtol=0.02, atol=0.02)
    assert torch.equal(got_kv[1], want_kv[1])


@pytest.mark.timeout(360)
def test_bench_w7_quick_json(tmp_path: Path) -> None:
    """``bench --quick --workloads W7``: every W7 row has positive samples; both targets ran."""
    out = tmp_path / "w7.json"
    p = subprocess.run(
        [sys.executable, "-m", "lmcache_kv_fast", "bench", "--quick", "--no-progress",
         "--workloads", "W7", "--no-torch-backend", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=_bench_env(), cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert not doc["errors"]
    n = doc["default_threads"]
    records = {(r["path"], r["op"]): r for r in doc["records"]}
    for path, op in [("upstream", "W7 loop (plain-torch SnapKV+rope)"),
                     (f"kvfast-native-{n}t", "W7 batch (edits.snapkv+rope)"),
                     (f"kvfast-native-{n}t", "W7 retrieve (1 sequence)"),
                     (f"kvfast-native-{n}t", "W7 edit (1 sequence)")]:
        assert _positive(records[(path, op)]["samples"]), (path, op)
        assert op in p.stdout
    assert len(records[(f"kvfast-native-{n}t", "W7 edit (1 sequence)")]["samples"]) == 3
    targets = {t["name"]: t for t in doc["targets"]}
    for name in ("W7 SnapKV+rope: batch.rewrite vs upstream loop",
                 "W7 SnapKV+rope: edit / retrieve of one sequence"):
        assert targets[name]["value"] > 0, targets[name]
        assert name in p.stdout


def test_w3f_time_ratio_growth_and_info_targets() -> None:
    """W3F's targets: a paired time ratio, the largest memory growth, info lines without verdict."""
    from benches.harness import cli, edits, helpers, names, report, sizes, stats  # noqa: F401
    from benches.harness import targets as bt

    ours, roof, seq = names.kvf_native(2), names.roofline(2), 256 << 20

    def rec(path: str, op: str, xs: list[float], **extra: object) -> dict:
        return {"path": path, "op": op, "nbytes": 1 << 30, "samples": xs, "reps": [0, 1],
                "during": [names.W3F] * 2, "phases": [], "failures": 0, **extra}

    records = {
        (ours, names.W3F_PLAIN): rec(ours, names.W3F_PLAIN, [1.2, 1.0]),
        (ours, names.W3F_DROP): rec(ours, names.W3F_DROP, [0.5, 0.5], seq_bytes=seq,
                                    private_growth=[1 << 20, 64 << 20],
                                    rss_anon_growth=[0, 1 << 20]),
        (ours, names.W3F_ROPE): rec(ours, names.W3F_ROPE, [0.6, 0.5]),
        (roof, names.W3F_COPY): rec(roof, names.W3F_COPY, [0.25, 0.2]),
    }
    rows = stats.rows_of(records)
    stats.add_ratios(rows, records, 2)
    assert rows[(ours, names.W3F_DROP)].x_roofline == pytest.approx((0.5 + 0.4) / 2)
    got = {t.name: t for t in bt.compute_targets(rows, records, {}, 2) if "W3F" in t.name}
    assert len(got) == 8
    drop = got["W3F fused drop vs plain fn (both batch.rewrite)"]
    assert drop.value == pytest.approx(2.2) and drop.status == "PASS"
    memcpy = got["W3F fused drop time / flat memcpy of the input"]
    assert memcpy.value == pytest.approx((2.0 + 2.5) / 2) and memcpy.best == pytest.approx(2.5)
    assert memcpy.detail.endswith("paired") and memcpy.status == "PASS"
    growth = got["W3F fused drop: private growth / one sequence's KV"]
    assert (growth.value, growth.best, growth.status) == (0.25, 1 / 256, "PASS")
    assert got["W3F fused drop+llama3 time / flat memcpy of the input"].status == "info"
    assert got["W3F plain fn: private growth / one sequence's KV"].status == "n/a"
    buf = io.StringIO()
    bt.print_targets(list(got.values()), buf)
    assert "info  W3F fused drop+llama3 time" in buf.getvalue()
    assert "4 PASS, 0 MISS (0 of them beyond their ceiling), 2 info, 2 n/a" in buf.getvalue()
    # W3F is only run when named, and sizes its L1 like W3
    assert "W3F" not in cli.DEFAULT_WORKLOADS
    s = sizes.Sizes()
    assert sizes.shm_l1_gib(s, ["W3F"]) == sizes.shm_l1_gib(s, ["W3"]) > sizes.shm_l1_gib(s, [])


@pytest.mark.timeout(360)
def test_bench_w3f_quick_json(tmp_path: Path) -> None:
    """``bench --quick --workloads W3F``: plain fn, both fused drops and the memcpy, checked."""
    out = tmp_path / "w3f.json"
    p = subprocess.run(
        [sys.executable, "-m", "lmcache_kv_fast", "bench", "--quick", "--no-progress",
         "--workloads", "W3F", "--no-torch-backend", "--no-upstream", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=_bench_env(), cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert not doc["errors"]
    n, seqs = doc["default_threads"], doc["sizes"]["w3_sequences"]
    records = {(r["path"], r["op"]): r for r in doc["records"]}
    ours = f"kvfast-native-{n}t"
    for path, op, fused in [(ours, "W3F batch (plain fn)", 0),
                            (ours, "W3F batch (fused drop)", seqs),
                            (ours, "W3F batch (fused drop+llama3)", seqs),
                            (f"roofline-{n}t", "W3F memcpy (1 seq x N, summed)", None)]:
        rec = records[(path, op)]
        assert _positive(rec["samples"]) and rec["failures"] == 0, (path, op, rec["note"])
        assert op in p.stdout
        if fused is not None:  # every sequence on the path it should take; memory sampled
            assert rec["fused"] == [fused] * len(rec["samples"]), rec["fused"]
            assert len(rec["private_growth"]) == len(rec["samples"]), rec
            assert rec["mem_samples"][0] >= 1 and rec["seq_bytes"] > 0
    info = next(i for i in doc["workers"] if i.get("worker") == "native")
    assert info["W3F_drop_readback_exact"] is True, info.get("W3F_drop_readback")
    rope = info["W3F_drop+llama3_readback"]
    assert rope["failure"] == "" and rope["v_exact"] and rope["k_close"], rope
    assert rope["sequences"] == seqs and rope["plain_torch_max_abs"] <= 2 ** -5, rope
    assert "native.W3F_drop_readback_exact=True" in p.stdout
    targets = {t["name"]: t for t in doc["targets"] if t["name"].startswith("W3F")}
    assert len(targets) == 8
    for t in targets.values():
        assert t["status"] in ("PASS", "MISS", "info") and math.isfinite(t["value"]), t
    assert targets["W3F fused drop vs plain fn (both batch.rewrite)"]["detail"].endswith("paired")
