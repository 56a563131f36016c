"""The engine example and the engine-loop benchmark (W5), on the shared engine (the
example's and ``bench --engine``'s own server and engine start is what the fixtures do;
``./scripts/run.sh`` runs the example that way)."""

from __future__ import annotations

import json
import logging

from conftest import load_example


def test_engine_token_dropping_example(caplog, engine_server, offline_engine):
    """The example's workflow on the shared engine (./scripts/run.sh runs it with its own)."""
    with caplog.at_level(logging.INFO, logger="engine_token_dropping"):
        assert load_example("engine_token_dropping").run(
            prompts=2, tokens=600, decode_tokens=2, seed=8080, server=engine_server,
            engine=offline_engine)
    text = caplog.text
    # 600 tokens: 512 cached; 461 kept after dropping every 10th; 256 stored (1 chunk)
    assert "external prefix hits per prompt [256, 256] (expected [256, 256]" in text
    assert "CPU engine KV: 2 layers, 2 KV heads x 64, bfloat16, block_size 128" in text
    for phase in ("engine prefill", "SDK connect", "SDK retrieve", "SDK edit", "SDK store",
                  "engine decode"):
        assert phase in text
    assert "token dropping through the engine: OK" in text


def test_bench_engine_quick(tmp_path, capsys, engine_server, offline_engine, model_name):
    """W5 (``bench --engine --quick``) on the shared engine: every path right, the table out."""
    from benches.harness.cli import build_parser
    from benches.harness.engine_loop import run_w5

    def registered() -> set[str]:
        return {k for k, e in engine_server.status()["non_cuda_context_meta"].items()
                if e["model_name"] == model_name}

    before = registered()
    out = tmp_path / "w5.json"
    args = build_parser().parse_args(["--engine", "--quick", "--json", str(out)])
    assert run_w5(args, server=engine_server, engine=offline_engine) == 0
    printed = capsys.readouterr().out
    left = registered() - before
    assert not left, left  # W5 left no registration behind (ours or upstream's)
    assert "W5 engine loop: 3 prompts x 528 tokens" in printed
    doc = json.loads(out.read_text())
    rows = {r["path"]: r for r in doc["rows"]}
    if engine_server.http().version().startswith("0.5.6"):
        assert "upstream / kvfast: SDK time x" in printed
        assert set(rows) == {"kvfast", "kvfast batch.rewrite", "upstream"}
    else:  # upstream runs in this process: its 0.5.6 SDK cannot speak to a newer server
        assert "upstream path skipped: this process's lmcache 0.5.6 SDK" in printed
        assert set(rows) == {"kvfast", "kvfast batch.rewrite"}
    for r in rows.values():
        assert r["ok_reps"] == r["reps"] == 1, r
        assert 0 < r["sdk_share"] < 1 and r["sdk_gbps"] > 0
    for reps in doc["reps"].values():
        assert reps[0]["hits"] == reps[0]["expected"] == [256] * 3
