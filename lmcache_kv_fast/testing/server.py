"""Start and stop a real LMCache MP server (``lmcache==0.5.x``) on 127.0.0.1.

Each server gets free ports and a unique ``--shm-name``; it is always stopped (SIGTERM,
then SIGKILL of its process group) and its shared-memory segment removed, also when the
start fails. Usable as a context manager.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq

from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.constants import SHM_POOL_PREFIX
from lmcache_kv_fast.protocol.ops import GEN_056, Generation, Op, parse_version
from lmcache_kv_fast.testing.logtail import log_tail
from lmcache_kv_fast.transport.http import HttpInfoClient

logger = logging.getLogger(__name__)

_COUNTER = itertools.count()
SERVER_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONUNBUFFERED": "1",
}


#: glibc settings for the server process (the recommended deployment,
#: docs/deployment.md). The pickle plane makes the server allocate several transient
#: buffers of the payload's size per request (ZMQ receive, msgpack ``bin``, the pickle's
#: bytes, ``torch.load``'s storage, and the reverse for a retrieve); glibc serves those
#: from fresh mmaps (above 32 MiB, or any size in a thread's own arena above its 64 MiB
#: heaps) and unmaps them on free, so each one page-faults anew. One arena and a 512 MiB
#: mmap threshold keep them in a reused heap: faster pickle-plane calls for more resident
#: heap (docs/deployment.md). The SHM plane does not allocate per request and is
#: unaffected. Variables the caller already set are kept.
MALLOC_TUNING_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(512 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}

#: Set to 1 to keep every test/bench server's log file after it stops.
KEEP_LOGS_ENV = "LMCACHE_KV_FAST_KEEP_SERVER_LOGS"


#: ``--server-module`` spec of 0.5.7's query store (``store_q``/``register_q_cache``; 0.5.6
#: had ``--enable transfer_query`` instead). Needs ``--supported-transfer-mode auto``.
QSTORE_MODULE: Mapping[str, Any] = {
    "module_path": "lmcache.v1.multiprocess.plugin_modules.qstore"}


class ServerStartError(RuntimeError):
    """The server did not become ready; the message carries the tail of its log."""


def tcp_open(port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` (gRPC readiness)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout):
        return True
    return False


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def zmq_noop(url: str, generation: Generation = GEN_056, timeout: float = 1.0) -> bool:
    """Send one ``noop`` on a fresh DEALER; True if the server's ZMQ loop answered."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A peer that is not a ZMQ server drops the connection at once; a send would then block.
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
    try:
        sock.connect(url)
        uid = codec.encode(secrets.randbits(31))
        try:
            sock.send_multipart([uid, codec.encode(generation.op_frame_value(Op.NOOP))])
        except zmq.Again:
            return False
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if sock.poll(int(left * 1000) + 1):
                frames = sock.recv_multipart()
                if frames and frames[0] == uid:
                    return True
        return False
    finally:
        sock.close(linger=0)


class LMCacheServer:
    """A real LMCache MP server child process.

    Args:
        shm: True for the SHM data plane (``--shm-name`` + ``--no-l1-use-lazy``), False for
            the pickle plane.
        chunk_size: ``--chunk-size``.
        l1_size_gb: ``--l1-size-gb`` (also the SHM segment size).
        python: Interpreter of the venv that has ``lmcache`` installed.
        version: Server version string (selects the launch command and op table);
            None means whatever ``lmcache`` the interpreter has (0.5.6 expected).
        extra_args: More server flags (e.g. reap timeouts).
        malloc_tuning: Start the server with :data:`MALLOC_TUNING_ENV` (glibc keeps the
            pickle plane's per-request buffers instead of mapping fresh pages each time);
            False runs it with glibc's defaults.
        keep_log: Keep the server's log file (a temporary file) after :meth:`stop`; by
            default it is deleted then, unless ``LMCACHE_KV_FAST_KEEP_SERVER_LOGS=1`` is
            set. :meth:`stop` logs the path of a kept log.
        startup_timeout: Seconds to wait for readiness.
        api_key: Protect the server's HTTP API with this key (0.5.7+; written to a private
            temporary file passed as ``--api-key-file``); :meth:`http`, :meth:`status`,
            :meth:`clear` and the readiness check send it.
        api_key_file: An existing key file (one line) for ``--api-key-file`` instead; its
            key is read for :meth:`http` unless ``api_key`` is given too.
        server_modules: ``--server-module`` specs (a JSON object as a mapping or a JSON
            string), e.g. :data:`QSTORE_MODULE` for query tensors on 0.5.7.
        transport: ``"zmq"`` (default) or ``"grpc"`` (``--transport grpc``; :attr:`url` is
            then ``grpc://``; the server's venv needs grpcio).
    """

    def __init__(
        self,
        *,
        shm: bool = True,
        chunk_size: int = 256,
        l1_size_gb: float = 1.0,
        python: str | None = None,
        version: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 90.0,
        max_workers: int | None = None,
        keep_log: bool | None = None,
        malloc_tuning: bool = True,
        api_key: str | None = None,
        api_key_file: str | os.PathLike[str] | None = None,
        server_modules: Sequence[Mapping[str, Any] | str] = (),
        transport: str = "zmq",
    ) -> None:
        self.shm = shm
        self.chunk_size = chunk_size
        self.l1_size_gb = l1_size_gb
        self.python = python or sys.executable
        self.version = version
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.max_workers = max_workers
        if keep_log is None:
            keep_log = os.environ.get(KEEP_LOGS_ENV, "") not in ("", "0")
        self.keep_log = keep_log
        self.malloc_tuning = malloc_tuning
        if transport not in ("zmq", "grpc"):
            raise ValueError(f"transport must be 'zmq' or 'grpc', got {transport!r}")
        self.transport = transport
        self.server_modules = [m if isinstance(m, str) else json.dumps(dict(m))
                               for m in server_modules]
        self._setup_api_key(api_key, api_key_file)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.http_port = 0
        self.shm_name = ""
        self._log_file: Any = None
        self.log_path: Path | None = None

    def _setup_api_key(self, api_key: str | None,
                       api_key_file: str | os.PathLike[str] | None) -> None:
        self.api_key = api_key
        self.api_key_file = Path(api_key_file) if api_key_file is not None else None
        self._own_key_file = False
        if api_key is None and api_key_file is None:
            return
        if not self.is_057:
            raise ValueError(
                f"api_key/api_key_file need an LMCache 0.5.7+ server (--api-key-file); "
                f"this one is {self.version or 'the running venv (0.5.6)'}")
        if api_key is None and self.api_key_file is not None:
            self.api_key = self.api_key_file.read_text(encoding="ascii").strip()

    @property
    def is_057(self) -> bool:
        """Whether the server is 0.5.7 or later (its flags and dialect differ)."""
        parsed = parse_version(self.version) if self.version is not None else None
        return parsed is not None and parsed >= (0, 5, 7)

    # -- addresses -------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Request URL of the server (``tcp://`` for ZMQ, ``grpc://`` for gRPC)."""
        scheme = "grpc" if self.transport == "grpc" else "tcp"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """HTTP URL of the server."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pool_segment(self) -> str:
        """Name of the L1 pool segment in /dev/shm ('' for pickle)."""
        return f"{SHM_POOL_PREFIX}{self.shm_name}" if self.shm_name else ""

    def warm_pool(self, block: int = 64 << 20) -> int:
        """Give every page of the SHM pool memory once, as a server that has run a while has.

        A fresh server's pool is a sparse file: the first store into each page allocates
        and zeroes it (in whichever process writes first), so the first GiBs stored cost
        several times what later ones do. Benchmarks that compare steady-state clients
        call this after start. Only the pool's holes are written (with zeros, which is
        what a hole reads as), so stored objects are never touched; but a store racing
        with it into a hole could be overwritten, so call it before anything stores.

        Returns:
            Bytes written (0 for a pickle server or a pool already fully allocated).
        """
        if not self.shm_name:
            return 0
        path = f"/dev/shm/{self.pool_segment}"
        fd = os.open(path, os.O_RDWR)
        written = 0
        try:
            size = os.fstat(fd).st_size
            zeros = bytes(min(block, max(size, 1)))
            off = 0
            while off < size:
                hole = os.lseek(fd, off, os.SEEK_HOLE)
                if hole >= size:
                    break
                try:
                    end = min(size, os.lseek(fd, hole, os.SEEK_DATA))
                except OSError:  # ENXIO: no data after the hole
                    end = size
                pos = hole
                while pos < end:
                    n = os.pwrite(fd, memoryview(zeros)[: min(block, end - pos)], pos)
                    pos += n
                written += end - hole
                off = end
        finally:
            os.close(fd)
        logger.info("warmed the SHM pool %s: %d MiB allocated", self.pool_segment,
                    written >> 20)
        return written

    @property
    def generation(self) -> Generation:
        """Wire dialect of this server (for raw calls in tests)."""
        from lmcache_kv_fast.protocol.ops import generation_for

        if self.version is None:
            return GEN_056
        gen = generation_for(self.version)
        return gen if gen is not None else GEN_056

    def http(self, timeout: float = 10.0) -> HttpInfoClient:
        """An HTTP info client for this server (sending its API key, if it has one)."""
        return HttpInfoClient(self.http_url, timeout, api_key=self.api_key)

    def requests_ready(self, timeout: float = 1.0) -> bool:
        """Whether the request port answers: a ZMQ ``noop``, or a TCP accept for gRPC."""
        if self.transport == "grpc":
            return tcp_open(self.port, timeout)
        return zmq_noop(self.url, self.generation, timeout=timeout)

    # -- lifecycle -------------------------------------------------------------------
    def command(self) -> list[str]:
        """The server command line."""
        parsed = parse_version(self.version) if self.version is not None else None
        # 0.5.1-0.5.5's `lmcache server` entry point dies on a missing optional module
        use_module = parsed is not None and parsed < (0, 5, 6)
        if use_module:
            cmd = [self.python, "-m", "lmcache.v1.multiprocess.http_server"]
        else:
            exe = Path(self.python).with_name("lmcache")
            cmd = [str(exe), "server"] if exe.exists() else [
                self.python, "-m", "lmcache.v1.multiprocess.http_server"]
        cmd += [
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", f"{self.l1_size_gb:g}",
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto",
        ]
        if self.max_workers is not None:
            cmd += ["--max-workers", str(self.max_workers)]
        if self.shm:
            cmd += ["--shm-name", self.shm_name, "--no-l1-use-lazy"]
        else:  # 0.5.1-0.5.3 otherwise make an SHM pool named after their pid
            cmd += ["--shm-name", ""]
        if self.transport != "zmq":
            cmd += ["--transport", self.transport]
        for spec in self.server_modules:
            cmd += ["--server-module", spec]
        if self.api_key_file is not None:
            cmd += ["--api-key-file", str(self.api_key_file)]
        return cmd + self.extra_args

    def start(self) -> LMCacheServer:
        """Start the server and wait until HTTP and a ZMQ ``noop`` answer.

        Raises:
            ServerStartError: It exited or did not become ready in time.
        """
        last_err: Exception | None = None
        for _attempt in range(3):  # a port picked as free may be taken meanwhile
            try:
                self._start_once()
                return self
            except ServerStartError as err:
                last_err = err
                self.stop()
                if "Address already in use" not in str(err):
                    break
        raise last_err  # type: ignore[misc]

    def _write_key_file(self) -> None:
        """Put ``api_key`` in a private temporary file for ``--api-key-file``."""
        if self.api_key is None or self.api_key_file is not None:
            return
        fd, path = tempfile.mkstemp(prefix="lmcache-api-key-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="ascii") as f:  # mkstemp: mode 0600
            f.write(self.api_key + "\n")
        self.api_key_file = Path(path)
        self._own_key_file = True

    def _start_once(self) -> None:
        self._write_key_file()
        self.port, self.http_port = free_port(), free_port()
        while self.http_port == self.port:
            self.http_port = free_port()
        self.shm_name = (
            f"lmckvf{os.getpid()}x{next(_COUNTER)}x{secrets.token_hex(3)}" if self.shm else ""
        )
        fd, path = tempfile.mkstemp(prefix="lmcache-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self._log_file = open(path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=self._env(), start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout
        http = self.http(timeout=1.0)
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"LMCache server exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"LMCache server not ready after {self.startup_timeout}s:\n{self.log_tail()}"
                )
            try:
                http.get("/config")
            except Exception:
                time.sleep(0.2)
                continue
            if self.requests_ready(timeout=1.0):
                break
        logger.info("LMCache server ready: %s %s shm=%r", self.url, self.http_url,
                    self.pool_segment)

    @property
    def server_env(self) -> dict[str, str]:
        """Variables set for the server process on top of the caller's environment.

        The tracking/banner switches and, with ``malloc_tuning``, glibc's settings.
        """
        extra = dict(SERVER_ENV)
        if self.malloc_tuning:
            extra.update({k: v for k, v in MALLOC_TUNING_ENV.items() if k not in os.environ})
        return extra

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.server_env}
        env.pop("LMCACHE_KV_FAST_BACKEND", None)
        return env

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server log."""
        return log_tail(self.log_path, n)

    def kill(self) -> None:
        """SIGKILL the server (fault tests); its segment stays until :meth:`stop`."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); remove its segments and log. Idempotent.

        The log file stays when ``keep_log`` is set.
        """
        self._stop(remove_log=not self.keep_log)
        if self._own_key_file and self.api_key_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.api_key_file.unlink()
            self.api_key_file, self._own_key_file = None, False

    def _stop(self, remove_log: bool) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # stray children of the group
        if self.pool_segment:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{self.pool_segment}")
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
            if self.log_path is not None:
                if remove_log:
                    with contextlib.suppress(FileNotFoundError):
                        self.log_path.unlink()
                elif self.keep_log:
                    logger.info("LMCache server log kept: %s", self.log_path)

    def restart(self) -> None:
        """Stop and start again on the same ports and segment name (fault tests)."""
        port, http_port, shm_name = self.port, self.http_port, self.shm_name
        self._stop(remove_log=False)  # the restarted server appends to the same log
        self.port, self.http_port, self.shm_name = port, http_port, shm_name
        self._log_file = open(self.log_path, "ab")  # type: ignore[arg-type]  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=self._env(), start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout
        while not self.requests_ready(timeout=0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ServerStartError(f"restart failed:\n{self.log_tail()}")

    def status(self) -> dict[str, Any]:
        """``GET /status``."""
        return self.http().status()

    def settled_status(self, timeout: float = 2.0) -> dict[str, Any]:
        """``GET /status`` once no session, prefetch job or lock is left (or ``timeout``).

        The SDK does not wait for the acknowledgements of a retrieve's ``commit_retrieve``
        and ``end_session`` (sent after the data moved; the end follows the commit's
        acknowledgement, collected within ~10 ms), so the server may still be processing
        them for a few milliseconds after a call returns. A real leak stays and shows in
        the returned status.
        """
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            l1 = st.get("storage_manager", {}).get("l1_manager", {})
            if (st.get("active_sessions") == 0 and st.get("active_prefetch_jobs") == 0 and
                    l1.get("read_locked_count", 0) == 0) or time.monotonic() >= deadline:
                return st
            time.sleep(0.02)

    def clear(self) -> None:
        """Clear L1 (``POST /cache/clear`` with force)."""
        self.http().clear_cache(force=True)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def lmcache_available(python: str | None = None) -> bool:
    """Whether the interpreter can import the LMCache server."""
    exe = python or sys.executable
    if exe == sys.executable:
        import importlib.util

        return importlib.util.find_spec("lmcache") is not None
    return shutil.which(exe) is not None
