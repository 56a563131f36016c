"""Child processes in the engine venv (``.venv-engine``), driven over JSON-lines pipes.

The vLLM engine, the transformers oracle and the tiny-model writer need vLLM/transformers,
which live in their own venv (``scripts/engine-venv.sh``); the tests and the SDK run in the
main venv. :class:`EngineChild` starts one of the standalone scripts of
``testbed/engine_side/`` with that venv's interpreter in its own process
group and exchanges one JSON object per line with it:

* request ``{"id": n, "op": name, "args": {...}}`` on the child's stdin;
* reply ``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false, "error": text}``
  on the child's stdout (the child moves everything else it prints to its log);
* tensors travel as ``torch.save`` files in :attr:`EngineChild.tmp_dir`.

Every wait has a timeout; :meth:`EngineChild.stop` ends the whole process group (SIGTERM,
then SIGKILL) and removes the temporary directory, also after a failed start.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from lmcache_kv_fast.testing.logtail import log_tail

logger = logging.getLogger(__name__)

#: Environment variable naming the engine venv (default ``<repo>/.venv-engine``).
ENGINE_VENV_ENV = "LMCACHE_ENGINE_VENV"
#: Directory of the engine-side scripts.
ENGINE_SIDE_DIR = Path(__file__).resolve().parent / "engine_side"
#: Repository root (the checkout this package lives in).
REPO_ROOT = Path(__file__).resolve().parents[1]

#: LMCache version of the test servers and the engine's connector (default: 0.5.6, the
#: venvs' own); another one runs its servers from ``.venv-compat/<ver>`` and the engine
#: with that version's connector from ``<engine venv>/lmcache-<ver>`` (engine-venv.sh).
SERVER_VERSION_ENV = "LMCACHE_KV_FAST_TEST_SERVER"
#: Set to 1 to keep the engine children's logs and files (their paths are logged).
KEEP_LOGS_ENV = "LMCACHE_KV_FAST_KEEP_ENGINE_LOGS"

CHILD_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONUNBUFFERED": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class EngineChildError(RuntimeError):
    """An engine-venv child failed, timed out or answered an error (message has its log tail)."""


def engine_python() -> Path:
    """Interpreter of the engine venv.

    Returns:
        ``$LMCACHE_ENGINE_VENV/bin/python`` or ``<repo>/.venv-engine/bin/python``.

    Raises:
        EngineChildError: The venv does not exist (run ``scripts/engine-venv.sh``).
    """
    root = Path(os.environ.get(ENGINE_VENV_ENV) or REPO_ROOT / ".venv-engine")
    exe = root / "bin" / "python"
    if not exe.exists():
        raise EngineChildError(
            f"no engine venv at {root}: run scripts/engine-venv.sh (or set {ENGINE_VENV_ENV})"
        )
    return exe


def server_version() -> str | None:
    """The LMCache version ``LMCACHE_KV_FAST_TEST_SERVER`` asks for (None: the default)."""
    return os.environ.get(SERVER_VERSION_ENV) or None


def connector_path(version: str) -> Path:
    """Where the engine venv keeps LMCache ``version`` beside its own (its connector).

    Raises:
        EngineChildError: It was not installed (``scripts/engine-venv.sh`` installs 0.5.7rc2).
    """
    path = engine_python().parents[1] / f"lmcache-{version}"
    if not (path / "lmcache").is_dir():
        raise EngineChildError(
            f"no LMCache {version} in the engine venv at {path}: run scripts/engine-venv.sh"
        )
    return path


#: Where vLLM opens its ZMQ IPC sockets (default the system temp dir, where a killed
#: engine leaves them): each engine gets a directory of its own, removed when it stops.
RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for an engine-venv child: the caller's, minus this venv, plus quiet switches.

    With ``LMCACHE_KV_FAST_TEST_SERVER`` set, that LMCache version's package comes first.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    version = server_version()
    if version is not None:
        env["PYTHONPATH"] = str(connector_path(version))
    env.update(CHILD_ENV)
    if extra:
        env.update(extra)
    return env


def stop_group(proc: subprocess.Popen[Any] | None, timeout: float = 30.0) -> None:
    """End a child started with ``start_new_session=True``, then its whole process group.

    SIGTERM to the leader only, so it can shut its own children down and unlink their
    shared memory (vLLM's engine core keeps ``psm_*`` ring buffers in /dev/shm; a SIGTERM
    to the whole group at once kills the children first and leaks them); after
    ``timeout`` s SIGKILL the group. Members left after the leader exited get SIGTERM, a
    moment, then SIGKILL. Idempotent.
    """
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(1.0)


class EngineChild:
    """One engine-side script running as a JSON-lines RPC child.

    Args:
        script: File name in ``engine_side/`` (e.g. ``"llm_driver.py"``).
        config: JSON-serialisable start configuration (passed as ``argv[1]``).
        name: Short name for logs and errors.
        env: Extra environment variables.
        start_timeout: Seconds to wait for the child's ``ready`` reply.
        python: Interpreter to run the script with (default: the engine venv's); any
            interpreter with what the script imports (e.g. ``sys.executable`` for a script
            that needs only ``lmcache``).
    """

    def __init__(self, script: str, config: dict[str, Any], *, name: str,
                 env: dict[str, str] | None = None, start_timeout: float = 300.0,
                 python: str | Path | None = None) -> None:
        self.python = python
        self.script = ENGINE_SIDE_DIR / script
        self.config = dict(config)
        self.name = name
        self.env = env or {}
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp_dir: Path | None = None
        self.log_path: Path | None = None
        self.ready_info: Any = None
        self._log_file: Any = None
        self._buf = b""
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineChild:
        """Start the child and wait for its ``ready`` reply.

        Raises:
            EngineChildError: It exited, failed or was not ready in time (stopped then).
        """
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"lmckvf-{self.name}-"))
        self.log_path = self.tmp_dir / "child.log"
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        cfg = {**self.config, "tmp_dir": str(self.tmp_dir)}
        started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                [str(self.python or engine_python()), str(self.script), json.dumps(cfg)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
                env=child_env({RPC_DIR_ENV: str(self.tmp_dir), **self.env}), cwd=str(self.tmp_dir),
                start_new_session=True,
            )
            self.ready_info = self._read_reply(0, self.start_timeout, "start")
        except BaseException:
            self.stop()
            raise
        logger.info("%s ready in %.1fs (pid %d)", self.name, time.monotonic() - started,
                    self.proc.pid)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the child to exit, then end its process group; remove its files. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    proc.stdin.write(b'{"id": -1, "op": "exit", "args": {}}\n')
                    proc.stdin.flush()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout)
            stop_group(proc)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.tmp_dir is not None:
            keep = os.environ.get(KEEP_LOGS_ENV, "") not in ("", "0")
            if keep:
                logger.info("%s files kept in %s", self.name, self.tmp_dir)
            else:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def __enter__(self) -> EngineChild:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        """Whether the child process is running."""
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------------ calls
    def call(self, op: str, timeout: float = 300.0, **args: Any) -> Any:
        """Run ``op`` in the child and return its result.

        Raises:
            EngineChildError: The child is not running, answered an error or timed out
                (a timed-out child is stopped: its state is unknown).
        """
        if self.proc is None or self.proc.stdin is None:
            raise EngineChildError(f"{self.name}: not running")
        rid = next(self._ids)
        line = json.dumps({"id": rid, "op": op, "args": args}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except OSError as err:
            raise EngineChildError(f"{self.name}: cannot send {op}: {err}\n{self.log_tail()}") \
                from err
        return self._read_reply(rid, timeout, op)

    def tmp_path(self, name: str) -> Path:
        """A path in the child's temporary directory (for tensors handed over as files)."""
        if self.tmp_dir is None:
            raise EngineChildError(f"{self.name}: not running")
        return self.tmp_dir / name

    def call_load(self, op: str, timeout: float = 300.0, **args: Any) -> Any:
        """Run ``op`` with ``path=`` a fresh file; return what the child saved there.

        The child ``torch.save``-s its result to ``path``; the file is removed afterwards.
        """
        import torch

        path = self.tmp_path(f"{op}-{time.monotonic_ns()}.pt")
        try:
            self.call(op, timeout, path=str(path), **args)
            return torch.load(path)
        finally:
            path.unlink(missing_ok=True)

    def call_send(self, op: str, tensor: Any, key: str = "path", timeout: float = 300.0,
                  **args: Any) -> Any:
        """Run ``op`` with ``tensor`` saved to a fresh file passed as ``args[key]``.

        ``tensor`` may be None: then ``args[key]`` is None and no file is written. The
        file is removed afterwards.
        """
        if tensor is None:
            return self.call(op, timeout, **{key: None}, **args)
        import torch

        path = self.tmp_path(f"{op}-{time.monotonic_ns()}.pt")
        try:
            torch.save(tensor.contiguous(), path)
            return self.call(op, timeout, **{key: str(path)}, **args)
        finally:
            path.unlink(missing_ok=True)

    def _read_reply(self, rid: int, timeout: float, what: str) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                raw, self._buf = self._buf[:nl], self._buf[nl + 1:]
                msg = json.loads(raw)
                if msg.get("id") != rid:
                    continue  # a late reply to a call that timed out earlier
                if not msg.get("ok"):
                    raise EngineChildError(f"{self.name} {what} failed:\n{msg.get('error')}")
                return msg.get("result")
            left = deadline - time.monotonic()
            if left <= 0:
                tail = self.log_tail()
                self.stop()
                raise EngineChildError(f"{self.name}: no reply to {what} in {timeout:g}s\n{tail}")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    code = self.proc.wait(10)
                    tail = self.log_tail()
                    raise EngineChildError(
                        f"{self.name} exited with code {code} during {what}:\n{tail}"
                    )
                self._buf += chunk

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the child's log."""
        return log_tail(self.log_path, n)


class ChildOwner:
    """``start`` / ``stop`` / ``with`` of an object whose work runs in one :class:`EngineChild`.

    A subclass sets ``self._child`` in its constructor and overrides :meth:`_ready` to keep
    what the child's ``ready`` reply says.
    """

    _child: EngineChild

    def start(self) -> Self:
        """Start the child and wait until it is ready (stopped again if it fails)."""
        self._child.start()
        self._ready(dict(self._child.ready_info or {}))
        return self

    def _ready(self, info: dict[str, Any]) -> None:
        """Keep what the child's ``ready`` reply says (nothing by default)."""

    def stop(self) -> None:
        """Stop the child and its processes (idempotent)."""
        self._child.stop()

    @property
    def rpc_dir(self) -> Path | None:
        """The directory of the engine's IPC sockets while it runs (its own, removed on stop)."""
        return self._child.tmp_dir

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
