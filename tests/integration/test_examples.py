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
