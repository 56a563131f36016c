"""Bench W6's summary: the landing probe, the floor of any client's modify, and the
batched stream's default bound on streams in flight (no server or engine needed)."""

from __future__ import annotations

import json
import math

import pytest

from benches.harness.cli import build_parser
from benches.harness.w6 import W6Sizes, kv_geometry, modify_floor, print_w6, summarize
from lmcache_kv_fast.sdk import _modify as sdk_modify
from lmcache_kv_fast.sdk.batch import LMCacheBatchedStream


def _side(side: str, rep: int, modify_s: float, server: float, engine: float,
          priv: int) -> dict:
    return {"side": side, "rep": rep, "prefill_s": 1.0, "modify_s": modify_s, "decode_s": 0.5,
            "modify_rss_growth": priv + 60 * 2**20, "modify_private_growth": priv,
            "external_hits": 28672.0, "import_connect_s": 0.1,
            "modify_cpu_s": {"self": 0.2, "server": server, "engine": engine}}


def _land(rep: int, last: float, edit: float) -> dict:
    return {"side": "land", "rep": rep, "prefill_s": 1.0, "land_first_s": 0.005,
            "land_last_s": last, "edit_cpu_s": edit, "external_hits": 0.0}


def test_floor_is_the_server_and_edit_cpu_on_the_cores_the_engine_leaves():
    per = {"ours": {"modify_s": 0.3, "modify_cpu_server_s": 0.13, "modify_cpu_engine_s": 0.3},
           "upstream": {"modify_s": 0.4, "modify_cpu_server_s": 0.11,
                        "modify_cpu_engine_s": 0.36}}
    f = modify_floor(per, {"land_last_s": 0.05, "edit_cpu_s": 0.02}, cores=2)
    # the cheaper server CPU (upstream's), the smaller engine share (0.9 of a core)
    assert f["server_cpu_s"] == pytest.approx(0.11)
    assert f["engine_busy_cores"] == pytest.approx(0.9)
    assert f["floor_s"] == pytest.approx((0.11 + 0.02) / 1.1)
    assert f["max_possible_speedup"] == pytest.approx(0.4 / f["floor_s"])


def test_floor_is_the_last_store_when_that_is_later():
    per = {"ours": {"modify_s": 0.3, "modify_cpu_server_s": 0.01, "modify_cpu_engine_s": 0.0},
           "upstream": {"modify_s": 0.5, "modify_cpu_server_s": 0.01,
                        "modify_cpu_engine_s": 0.0}}
    f = modify_floor(per, {"land_last_s": 0.1, "edit_cpu_s": math.nan}, cores=2)
    assert f["edit_cpu_s"] == 0.0 and f["floor_s"] == pytest.approx(0.1)
    assert f["max_possible_speedup"] == pytest.approx(5.0)


def test_no_floor_without_both_sides_cpu():
    per = {"ours": {"modify_s": 0.3}, "upstream": {"modify_s": 0.4}}
    assert modify_floor(per, {"land_last_s": 0.05, "edit_cpu_s": 0.01}, cores=2) == {}
    assert modify_floor({"ours": per["ours"]}, {"land_last_s": 0.05}, cores=2) == {}


def test_summarize_keeps_the_land_side_out_of_the_sides_and_adds_the_floor():
    runs = [_side("ours", r, 0.3, 0.12, 0.3, 24 << 20) for r in range(3)]
    runs += [_side("upstream", r, 0.4, 0.10, 0.36, 100 << 20) for r in range(3)]
    runs += [_land(r, 0.05 + 0.01 * r, 0.017) for r in range(3)]
    doc = summarize(W6Sizes(), runs)
    assert set(doc["sides"]) == {"ours", "upstream"}
    assert doc["land"]["land_last_s"] == pytest.approx(0.06)
    assert doc["sides"]["ours"]["modify_cpu_server_s"] == pytest.approx(0.12)
    assert doc["floor"]["floor_s"] > 0
    assert doc["targets"]["modify_speedup"]["value"] == pytest.approx(0.4 / 0.3)
    assert doc["targets"]["modify_private_rss_ratio"]["value"] == pytest.approx(0.24)


@pytest.mark.parametrize(("cores", "expected"), [(1, 2), (2, 2), (3, 3), (4, 4), (64, 4)])
def test_default_streams_in_flight_follow_the_cores(monkeypatch, cores, expected):
    monkeypatch.setattr(sdk_modify.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert sdk_modify.default_max_in_flight() == expected
    assert LMCacheBatchedStream().max_in_flight == expected
    assert LMCacheBatchedStream(max_in_flight=7).max_in_flight == 7


def test_kv_geometry_flag():
    # Llama-3.2-1B's KV geometry by default; the test model's on request or by its config
    assert kv_geometry(build_parser().parse_args(["--w6"])) == (16, 8, 64)
    assert kv_geometry(build_parser().parse_args(["--w6", "--w6-kv-geometry", "test"])) \
        == (2, 2, 64)
    assert kv_geometry(build_parser().parse_args(["--w6", "--w6-kv-geometry", "8,8,128"])) \
        == (8, 8, 128)
    for bad in ("8,8", "8,8,100", "0,8,128", "a,b,c"):
        with pytest.raises(SystemExit, match="w6-kv-geometry"):
            kv_geometry(build_parser().parse_args(["--w6", "--w6-kv-geometry", bad]))


def test_kv_geometry_of_a_given_model(tmp_path):
    """``--w6-model``: the geometry in its config.json (head_dim given or derived); the test
    model's when the directory has no usable config."""
    def geometry(cfg):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        if cfg is not None:
            (d / "config.json").write_text(json.dumps(cfg))
        return kv_geometry(build_parser().parse_args(["--w6", "--w6-model", str(d)]))

    assert geometry({"num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "hidden_size": 2048, "head_dim": 64}) == (16, 8, 64)
    assert geometry({"num_hidden_layers": 4, "num_attention_heads": 8,
                     "hidden_size": 1024}) == (4, 8, 128)
    assert geometry(None) == geometry({"hidden_size": 1}) == (2, 2, 64)


class _Stream:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


class _KVSource:
    """What ``edit_cpu`` reads through: ``retrieve(tokens, salt)`` (a stream's cached KV)."""

    def __init__(self, kv) -> None:
        self.kv = kv

    def retrieve(self, tokens, salt):
        return None if self.kv is None else self.kv[:, :, : len(tokens)]


def test_edit_cpu_counts_the_cheaper_form_of_the_edit_per_stream():
    """The edit runs plainly and with its outputs in already-mapped pool memory; the
    cheaper counts, the median stream's times the streams; no KV: NaN."""
    import torch

    from benches.harness.w6_worker import drop_every, edit_cpu

    calls: list[int] = []
    drop = drop_every(10, "kv")

    def fn(tensors, tokens):
        calls.append(tensors["kv"].data_ptr())
        return drop(tensors, tokens)

    kv = torch.randn(2, 2, 512, 1024).to(torch.bfloat16)  # 4 MiB: the pool takes the output
    streams = [_Stream(list(range(512))) for _ in range(3)]
    cpu = edit_cpu(_KVSource(kv), streams, "", fn, "kv")
    assert 0 < cpu < 30 and math.isfinite(cpu)
    assert len(calls) == 3 * 3  # plain, untimed pooled, timed pooled per stream
    assert math.isnan(edit_cpu(_KVSource(None), streams, "", fn, "kv"))


def test_modify_memory_counts_the_result_buffers_prepared_during_the_prefill():
    """W6 adds what this SDK's result pool grew by over the prefill (the modify's buffers,
    mapped and faulted then) to the modify's growth; the rest of the prefill's memory and
    shared pages mapped before the phase are not the modify's."""
    from benches.harness.w6_worker import PeakRss, prepared_bytes
    from lmcache_kv_fast import _native
    from lmcache_kv_fast.copy import backend

    _native.result_pool_trim()
    try:
        pool0 = prepared_bytes()
        assert backend().reserve_results(8 << 20, 3) == 3  # what prefill() prepares
        prepared = prepared_bytes() - pool0
        assert prepared == 3 * (8 << 20)
        other = b"\x01" * (32 << 20)  # the prefill's own memory: not the modify's
        with PeakRss(prepared) as counted:
            pass
        with PeakRss() as plain:
            pass
        assert 3 * (8 << 20) <= counted.private < 3 * (8 << 20) + (8 << 20)
        assert 3 * (8 << 20) <= counted.growth < 3 * (8 << 20) + (8 << 20)
        assert plain.private < 8 << 20 and plain.growth < 8 << 20
        assert len(other) == 32 << 20
    finally:
        _native.result_pool_trim()


def test_summary_pairs_each_rep_of_both_sides_and_prints_their_spread(capsys):
    runs = [_side("ours", 0, 0.25, 0.08, 0.2, 200 * 2**20),
            _side("upstream", 0, 5.0, 0.2, 0.9, 3000 * 2**20),
            _side("ours", 1, 0.40, 0.08, 0.3, 200 * 2**20),
            _side("upstream", 1, 4.0, 0.2, 0.9, 3000 * 2**20),
            _side("ours", 2, 0.30, 0.08, 0.3, 200 * 2**20)]  # upstream's rep 2 missing
    doc = summarize(W6Sizes(), runs)
    assert [p["rep"] for p in doc["paired"]] == [0, 1]
    assert [p["ratio"] for p in doc["paired"]] == pytest.approx([20.0, 10.0])
    print_w6(doc)
    out = capsys.readouterr().out
    assert "0.250 / 5.000 (20.0x), 0.400 / 4.000 (10.0x)" in out
    assert "paired ratios 10.0x .. 20.0x, median 15.0x" in out


def test_statm_sampler_reads_what_status_says_and_sees_new_private_pages():
    """The 1 ms sampler reads statm (resident - shared = RssAnon) instead of parsing
    /proc/self/status: same counters, a tenth of the CPU inside the measured phase."""
    from benches.harness.w6_worker import StatmReader, status_kib

    statm = StatmReader()
    try:
        anon, rss = statm.read()
        assert abs(anon - status_kib("RssAnon")) < 4096
        assert abs(rss - status_kib("VmRSS")) < 4096
        block = bytearray(b"\x01" * (64 << 20))  # 64 MiB of private, touched pages
        anon2, _ = statm.read()
        assert anon2 - anon >= (60 << 20) // 1024
        assert len(block) == 64 << 20
    finally:
        statm.close()
