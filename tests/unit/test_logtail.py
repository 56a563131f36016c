"""Log excerpts for failure reports: the tail without noise, and the error reports wherever
they are in the log (a dead engine's traceback is followed by its shutdown's lines)."""

from __future__ import annotations

from lmcache_kv_fast.testing.logtail import log_errors, log_tail


def test_tail_and_errors(tmp_path):
    log = tmp_path / "engine.log"
    lines = [f"INFO request {i} 200 OK" for i in range(50)]
    lines += ["(EngineCore pid=1) ERROR 12-02 23:13:58 [core.py:1] EngineCore failed",
              "Traceback (most recent call last):",
              '  File "scheduler.py", line 3234, in _update_from_kv_xfer_finished',
              "    assert req_id in self.requests",
              "AssertionError"]
    lines += [f"INFO shutdown step {i}" for i in range(200)]
    log.write_text("\n".join(lines) + "\n")

    tail = log_tail(log, 10)
    assert tail.splitlines() == [f"INFO shutdown step {i}" for i in range(190, 200)]
    assert "AssertionError" not in tail  # what a tail alone misses
    # without the shutdown's lines the tail ends with the traceback
    assert log_tail(log, 3, drop=("shutdown",)).splitlines() == lines[52:55]

    errors = log_errors(log, context=5).splitlines()
    assert errors[0].endswith("EngineCore failed")
    assert "AssertionError" in errors and "    assert req_id in self.requests" in errors
    assert errors[-1] == "INFO shutdown step 4"  # the context after the last report
    assert len(log_errors(log, n=3).splitlines()) == 3  # the first lines: the root cause


def test_errors_windows_are_merged_and_separated(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("\n".join(["a ERROR one", "b", "c", "d", "e", "f ERROR two", "g"]))
    assert log_errors(log, context=1).splitlines() == ["a ERROR one", "b", "[...]",
                                                       "f ERROR two", "g"]
    assert log_errors(log, context=4).splitlines() == ["a ERROR one", "b", "c", "d", "e",
                                                       "f ERROR two", "g"]


def test_missing_or_clean_logs_give_nothing(tmp_path):
    assert log_tail(None, 5) == log_errors(None) == ""
    assert log_tail(tmp_path / "none.log", 5) == log_errors(tmp_path / "none.log") == ""
    clean = tmp_path / "clean.log"
    clean.write_text("INFO fine\nINFO still fine\n")
    assert log_errors(clean) == ""
    assert log_tail(clean, 1) == "INFO still fine"
