"""The runnable examples, against the real servers of both data planes."""

from __future__ import annotations

import logging

from conftest import load_example, make_model


def test_e2e_kv_edit(server, caplog):
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=64)
    with caplog.at_level(logging.INFO, logger="e2e_kv_edit"):
        assert load_example("e2e_kv_edit").run(server.url, server.http_url, m.name, tokens=1024, k=10)
    assert "edit read back EXACTLY (768 whole-chunk tokens)" in caplog.text


def test_batch_rewrite(server, caplog):
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=64)
    ex = load_example("batch_rewrite")
    with caplog.at_level(logging.INFO, logger="batch_rewrite"):
        assert ex.run(server.url, server.http_url, m.name, prompts=6, tokens=1024, k=10,
                      check=3, progress=False)
    assert caplog.text.count("edit read back EXACTLY (768 whole-chunk tokens)") == 3
    assert "seeded: 6 items: 6 ok" in caplog.text


def test_batch_rewrite_reports_a_wrong_read_back(server, caplog, monkeypatch):
    """The example's check is real: an edit that differs from what it stores fails it."""
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=64)
    ex = load_example("batch_rewrite")
    real = ex.drop_every_kth

    def off_by_one(k):
        fn = real(k)

        def wrong(kv, tokens, *, alloc):
            out, toks = fn(kv, tokens, alloc=alloc)
            out.add_(1)
            return out, toks

        return wrong

    monkeypatch.setattr(ex, "drop_every_kth", off_by_one)
    with caplog.at_level(logging.INFO, logger="batch_rewrite"):
        assert not ex.run(server.url, server.http_url, m.name, prompts=2, tokens=512, k=10,
                          check=1, progress=False)
    assert "edit read back WRONG" in caplog.text


# ------------------------------------------------------------------ the edits examples
def _edit_config() -> dict:
    """Llama-3.2-1B's RoPE on the small registered model (2 layers x 2 KV heads x 64)."""
    cfg = dict(load_example("_edit_example").LLAMA32_1B_CONFIG)
    return {**cfg, "num_hidden_layers": 2, "num_key_value_heads": 2}


def _run_edit_example(server, caplog, name: str) -> str:
    """Run examples/<name>.py's ``run`` on 2 prompts of 1024 tokens; its log."""
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=64)
    with caplog.at_level(logging.INFO, logger="edit_example"):
        assert load_example(name).run(server.url, server.http_url, m.name,
                                      config=_edit_config(), prompts=2, tokens=1024)
    assert "WRONG" not in caplog.text
    return caplog.text


def test_edits_drop(server, caplog):
    """keep / drop_every / keep_ratio(uniform): each prompt's edit read back exactly."""
    log = _run_edit_example(server, caplog, "edits_drop")
    assert log.count("read back EXACTLY") == 6
    assert "keep(first 256 and 512..767) (prompt 0): kept 512 of 1024 tokens: 0-255, " \
           "512-767; read back EXACTLY (512 whole-chunk tokens)" in log
    assert "drop_every(10) (prompt 1): kept 922 of 1024 tokens: 0-8, 10-18, " in log
    assert "keep_ratio(0.25, 'uniform') (prompt 0): kept 256 of 1024 tokens" in log


def test_edits_streaming(server, caplog):
    """StreamingLLM keeps the 4 sinks and the last 508 tokens."""
    log = _run_edit_example(server, caplog, "edits_streaming")
    assert log.count("read back EXACTLY (512 whole-chunk tokens)") == 2
    assert "streaming_llm(4, 508) (prompt 0): kept 512 of 1024 tokens: 0-3, 516-1023" in log


def test_edits_scored(server, caplog):
    """KeyDiff, L2 (4 sinks kept) and R-KV (its window of 8 kept) keep half the tokens."""
    log = _run_edit_example(server, caplog, "edits_scored")
    assert log.count("read back EXACTLY (512 whole-chunk tokens)") == 6
    for name in ("key_norm(0.5, keydiff, sinks=4)", "key_norm(0.5, l2, sinks=4)"):
        assert f"{name} (prompt 1): kept 512 of 1024 tokens: 0-" in log
    assert "rkv(queries, window=8, ratio=0.5) (prompt 0): kept 512 of 1024 tokens" in log
    line = next(x for x in log.splitlines() if "rkv(" in x and "(prompt 0): kept" in x)
    assert "1016-1023" in line, line  # the window


def test_edits_snapkv(server, caplog):
    """SnapKV with given queries keeps 30 % (308 tokens), the last 32 among them."""
    log = _run_edit_example(server, caplog, "edits_snapkv")
    assert log.count("read back EXACTLY (256 whole-chunk tokens)") == 2
    line = next(x for x in log.splitlines() if "(prompt 1): kept" in x)
    assert "kept 308 of 1024 tokens" in line and "992-1023" in line, line
