"""Child interpreters of the harness: their environment, the worker processes, progress."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lmcache_kv_fast.testing.logtail import log_tail

logger = logging.getLogger("benches.harness")

#: The checkout's root (this file is ``benches/harness/procs.py``).
ROOT = Path(__file__).resolve().parents[2]


def pkg_root() -> str:
    """The checkout's root: ``lmcache_kv_fast``, ``benches`` and ``testbed`` import from it."""
    return str(ROOT)


def child_env(backend: str | None = None) -> dict[str, str]:
    """The environment of a child interpreter (this checkout first on the path).

    Args:
        backend: ``LMCACHE_KV_FAST_BACKEND`` of the child (None: unset, the default).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [pkg_root(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.update({"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
                "LMCACHE_DISABLE_BANNER": "1", "PYTHONUNBUFFERED": "1"})
    env.pop("LMCACHE_KV_FAST_BACKEND", None)
    if backend is not None:
        env["LMCACHE_KV_FAST_BACKEND"] = backend
    return env




class Progress:
    """tqdm when installed (and enabled), else log lines."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        self.done = 0
        self.steps: list[tuple[str, float]] = []
        self._last = time.perf_counter()
        self.total = total
        self.enabled = enabled
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="bench", unit="step", file=sys.stderr)

    def step(self, label: str) -> None:
        """One step done (its seconds are kept in ``steps``)."""
        now = time.perf_counter()
        self.steps.append((label, round(now - self._last, 3)))
        self._last = now
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label[:40])
            self.bar.update(1)
        elif self.enabled:
            logger.info("[%d/%d] %s", self.done, self.total, label)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


class WorkerProc:
    """A worker interpreter driven over stdin/stdout (one command at a time)."""

    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        self.kind = spec["worker"]
        self.spec = {**spec, "out": str(workdir / f"{self.kind}.out.json")}
        spec_path = workdir / f"{self.kind}.json"
        spec_path.write_text(json.dumps(self.spec))
        self.log_path = workdir / f"{self.kind}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.alive = True
        self.skip_reason = ""
        self._q: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [(self.kind == "upstream" and spec.get("upstream_python")) or sys.executable,
             "-m", "benches.harness.worker", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=child_env(None if self.kind == "upstream" else self.kind),
        )
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"bench-{self.kind}-reader")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._q.put(line.rstrip("\n"))
            else:
                self._log.write(line)
        self._q.put(None)

    def _reply(self, timeout: float) -> str:
        try:
            line = self._q.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            return f"@@err timeout: no reply in {timeout:g} s"
        if line is None:
            self.alive = False
            return f"@@err worker {self.kind} exited ({self.proc.wait()}):\n{self.log_tail()}"
        return line

    def wait_ready(self, timeout: float) -> bool:
        """Wait for the worker's ``@@ready``; False (with ``skip_reason``) otherwise."""
        line = self._reply(timeout)
        if line == "@@ready":
            return True
        self.skip_reason = line[2:].removeprefix("skip ").removeprefix("err ")
        self.alive = False
        return False

    def call(self, msg: dict[str, Any], timeout: float) -> str | None:
        """Send one command; None on ``@@ok``, else the error text."""
        if not self.alive:
            return "worker not running"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            self.alive = False
            return f"worker {self.kind} gone: {err}"
        line = self._reply(timeout)
        return None if line == "@@ok" else line[2:].removeprefix("err ")

    def log_tail(self, n: int = 25) -> str:
        """The last ``n`` lines of the worker's log."""
        self._log.flush()
        return log_tail(self.log_path, n)

    def kill(self) -> None:
        """Kill the worker (no cleanup: use :meth:`close`)."""
        self.alive = False
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self, timeout: float = 120.0) -> dict[str, Any]:
        """Ask the worker to quit (it releases its L1 pages); return its results."""
        if self.alive and self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._reader.join(5)
        self._log.close()
        try:
            return json.loads(Path(self.spec["out"]).read_text())
        except (OSError, ValueError):
            return {"records": [], "notes": [], "info": {"worker": self.kind}}
