"""Compatibility-matrix helpers: every real LMCache MP server 0.5.1 .. 0.5.7rc2 and its own SDK.

* :func:`venv_python` finds the interpreter that has a given ``lmcache`` version
  (``.venv-compat/<ver>`` made by ``scripts/compat-venvs.sh``; 0.5.6 is also found in the
  running interpreter, the main ``.venv``).
* :func:`compat_server` builds an :class:`~lmcache_kv_fast.testing.LMCacheServer` for that
  version (0.5.1 .. 0.5.5 start with ``python -m lmcache.v1.multiprocess.http_server``).
* :class:`TheirSDK` runs "that version's own client" in a child process of that venv: it
  registers a vLLM-like HND CPU layout with that version's transfer context (0.5.1 .. 0.5.5
  take pickled IPC wrappers, so only their own client can), and stores / retrieves with that
  version's ``lmcache.sdk.kvcache`` (module functions in 0.5.1/0.5.2, context methods from
  0.5.3 on; 0.5.7's builds ``token_bytes`` keys itself). Tensors travel through
  ``torch.save`` files in a work directory.
* :func:`suite_server_kwargs` reads ``LMCACHE_KV_FAST_TEST_SERVER``: the server version the
  test suite's main server fixtures start (default: the main venv's 0.5.6).

This file is also the child's program: ``python -I compat.py --worker URL HTTP_URL`` runs
the worker loop (one JSON request per line on stdin, one JSON reply per line on stdout). So
its module level imports only the standard library.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from lmcache_kv_fast.testing.server import LMCacheServer

#: Every server version of the compatibility matrix, oldest first.
ALL_VERSIONS: tuple[str, ...] = (
    "0.5.1", "0.5.2", "0.5.3", "0.5.4", "0.5.5", "0.5.6", "0.5.7rc2")
#: The version of the main venv (its server is the default test server).
MAIN_VERSION = "0.5.6"
#: Versions whose matrix rows run in the default suite (the others only with ``-m compat``).
DEFAULT_VERSIONS: tuple[str, ...] = ("0.5.6", "0.5.7rc2")
#: Environment variable naming the server version the suite's main fixtures start.
TEST_SERVER_ENV = "LMCACHE_KV_FAST_TEST_SERVER"
#: Where ``scripts/compat-venvs.sh`` puts the per-version venvs (``LMCACHE_COMPAT_VENVS``).
REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONUNBUFFERED": "1",
}
_WORK_COUNTER = itertools.count()


def venvs_dir() -> Path:
    """Directory holding one venv per version (``.venv-compat`` of the checkout)."""
    return Path(os.environ.get("LMCACHE_COMPAT_VENVS", REPO_ROOT / ".venv-compat"))


def _installed_lmcache(python: str) -> str | None:
    if python == sys.executable:
        try:
            import importlib.metadata as md

            return md.version("lmcache")
        except Exception:  # not installed
            return None
    return None


def venv_python(version: str) -> str | None:
    """Interpreter with ``lmcache==version`` installed, or None when there is none.

    ``.venv-compat/<version>/bin/python`` counts once ``scripts/compat-venvs.sh`` finished it
    (its stamp file exists); for :data:`MAIN_VERSION` the running interpreter counts too.
    """
    venv = venvs_dir() / version
    py = venv / "bin" / "python"
    if py.exists() and any(venv.glob(".lmckvf-compat-*")):
        return str(py)
    if _installed_lmcache(sys.executable) == version:
        return sys.executable
    return None


def missing_venv_hint(version: str) -> str:
    """How to create the venv of ``version`` (for skip messages)."""
    return (
        f"no venv with lmcache=={version} (looked for {venvs_dir() / version}); create it with "
        f"`scripts/compat-venvs.sh {version}` or run `make test-compat`"
    )


def compat_server(version: str, *, shm: bool, **kw: Any) -> LMCacheServer:
    """An (unstarted) real server of ``version``; needs :func:`venv_python`.

    Raises:
        FileNotFoundError: No interpreter has that version.
    """
    from lmcache_kv_fast.testing.server import LMCacheServer

    py = venv_python(version)
    if py is None:
        raise FileNotFoundError(missing_venv_hint(version))
    return LMCacheServer(shm=shm, python=py, version=version, **kw)


def suite_server_version() -> str:
    """The server version the test suite runs against (``LMCACHE_KV_FAST_TEST_SERVER``).

    Unset or empty means :data:`MAIN_VERSION` (the main venv's server).
    """
    return os.environ.get(TEST_SERVER_ENV, "").strip() or MAIN_VERSION


def suite_server_kwargs() -> dict[str, Any]:
    """``LMCacheServer`` arguments that start the suite's server version.

    Empty for the main venv's own server; ``python``/``version`` of the version's venv
    (``.venv-compat/<ver>``, ``LMCACHE_COMPAT_VENVS``) otherwise.

    Raises:
        FileNotFoundError: No venv has that version (the message says how to make one).
    """
    if not os.environ.get(TEST_SERVER_ENV, "").strip():
        return {}
    version = suite_server_version()
    if version == MAIN_VERSION and _installed_lmcache(sys.executable) == version:
        return {}
    py = venv_python(version)
    if py is None:
        raise FileNotFoundError(f"{TEST_SERVER_ENV}={version}: {missing_venv_hint(version)}")
    return {"python": py, "version": version}


class TheirSDKError(RuntimeError):
    """The other version's client failed; the message carries its traceback."""


class TheirSDK:
    """A child process running ``lmcache==version``'s own client against one server.

    Args:
        version: lmcache version of the child (selects the venv).
        url: ZMQ URL of the server.
        http_url: HTTP URL of the server.
        workdir: Directory for the exchanged tensor files (and the child's log).
        timeout: Seconds any single request to the child may take.
    """

    def __init__(self, version: str, url: str, http_url: str, workdir: Path | str,
                 timeout: float = 120.0) -> None:
        py = venv_python(version)
        if py is None:
            raise FileNotFoundError(missing_venv_hint(version))
        self.version = version
        self.python = py
        self.url = url
        self.http_url = http_url
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / f"their-sdk-{version}-{next(_WORK_COUNTER)}.log"
        self._log: Any = None
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        self._files = itertools.count()
        self.removed_segments: list[str] = []

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> TheirSDK:
        """Start the child and check it imports that lmcache version."""
        env = {**os.environ, **SERVER_ENV}
        env.pop("LMCACHE_KV_FAST_BACKEND", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [self.python, "-I", str(Path(__file__).resolve()), "--worker", self.url,
             self.http_url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            start_new_session=True, cwd=self.workdir,
        )
        threading.Thread(target=self._reader, name=f"their-sdk-{self.version}",
                         daemon=True).start()
        try:
            got = self._call("version")
            if got != self.version:
                raise TheirSDKError(f"child runs lmcache {got}, expected {self.version}")
        except BaseException:
            self.stop()
            raise
        return self

    def _reader(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stop(self) -> None:
        """Stop the child (exit, then SIGKILL of its group) and remove its SHM segments."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    assert proc.stdin is not None
                    proc.stdin.write(b'{"cmd": "exit"}\n')
                    proc.stdin.flush()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            for stream in (proc.stdin, proc.stdout):
                with contextlib.suppress(Exception):
                    stream.close()  # type: ignore[union-attr]
            # KV-cache segments lmcache's wrap_kv_caches made for the registration
            for seg in Path("/dev/shm").glob(f"lmcache_kv_{proc.pid}_*"):
                self.removed_segments.append(seg.name)
                with contextlib.suppress(FileNotFoundError):
                    seg.unlink()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> TheirSDK:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the child's log."""
        from lmcache_kv_fast.testing.logtail import log_tail

        return log_tail(self.log_path, n)

    # -- requests --------------------------------------------------------------------
    def _call(self, cmd: str, **kw: Any) -> Any:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            raise TheirSDKError(f"lmcache {self.version} client is not running:\n{self.log_tail()}")
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"cmd": cmd, **kw}).encode() + b"\n")
        proc.stdin.flush()
        try:
            line = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            raise TheirSDKError(
                f"lmcache {self.version} client: {cmd} got no answer in {self.timeout}s:\n"
                f"{self.log_tail()}"
            ) from None
        if line is None:
            raise TheirSDKError(f"lmcache {self.version} client died during {cmd}:\n"
                                f"{self.log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise TheirSDKError(
                f"lmcache {self.version} client: {cmd} failed: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}"
            )
        return reply.get("result")

    def _path(self, what: str) -> Path:
        return self.workdir / f"{what}-{os.getpid()}-{next(self._files)}.pt"

    def register_hnd(self, model_name: str, *, num_layers: int, num_kv_heads: int,
                     head_size: int, dtype: str = "bfloat16", block_size: int = 16,
                     num_blocks: int = 4) -> int:
        """Register a vLLM-like HND CPU layout ``NL x [2, NB, NH, BS, HS]`` (docs/protocol.md Appendix C).

        Returns:
            The registration's instance id.
        """
        return int(self._call(
            "register", model=model_name, num_layers=num_layers, num_kv_heads=num_kv_heads,
            head_size=head_size, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
        ))

    def connect(self, model_name: str, timeout: float = 30.0, kind: str = "kv") -> int:
        """``lmcache.sdk.kvcache.connect`` (``kind="query"``: ``lmcache.sdk.qcache``'s, 0.5.6+).

        Returns:
            A handle for the other calls.
        """
        return int(self._call("connect", model=model_name, timeout=timeout, kind=kind))

    def store(self, handle: int, kv: torch.Tensor, tokens: list[int], cache_salt: str = "") -> bool:
        """That version's ``store(kv, tokens, cache_salt)``."""
        import torch

        path = self._path("kv")
        torch.save(kv.contiguous(), path)
        try:
            return bool(self._call("store", ctx=handle, kv=str(path), tokens=list(tokens),
                                   salt=cache_salt))
        finally:
            path.unlink(missing_ok=True)

    def retrieve(self, handle: int, tokens: list[int], cache_salt: str = "") -> torch.Tensor | None:
        """That version's ``retrieve(tokens, cache_salt)``."""
        import torch

        path = self._path("out")
        try:
            got = self._call("retrieve", ctx=handle, tokens=list(tokens), salt=cache_salt,
                             out=str(path))
            if got is None:
                return None
            return torch.load(path, weights_only=True)
        finally:
            path.unlink(missing_ok=True)

    def close(self, handle: int) -> None:
        """That version's ``close``."""
        self._call("close", ctx=handle)

    def register_nhd(self, model_name: str, *, num_layers: int, num_kv_heads: int,
                     head_size: int, block_size: int = 16, num_blocks: int = 4) -> int:
        """Register a vLLM-like NHD CPU layout ``NL x [2, NB, BS, NH, HS]`` (bf16, random).

        Returns:
            The registration's instance id (for :meth:`lmc_store` / :meth:`unregister`).
        """
        return int(self._call(
            "register", model=model_name, num_layers=num_layers, num_kv_heads=num_kv_heads,
            head_size=head_size, dtype="bfloat16", block_size=block_size,
            num_blocks=num_blocks, layout="NHD",
        ))

    def lmc_store(self, iid: int, tokens: list[int]) -> None:
        """Store ``tokens`` the engine's way, then end the session.

        The registration's first blocks go through ``submit_store`` of that version's
        transfer context (what the server announces as ``stored`` KV events).
        """
        self._call("lmc_store", iid=iid, tokens=list(tokens))

    def unregister(self, iid: int) -> None:
        """Unregister the registration ``iid`` (that version's ``unregister``)."""
        self._call("unregister", iid=iid)


class TheirContext:
    """That version's ``lmcache.sdk.kvcache`` context, in a child process of its venv.

    The upstream oracle for a server the running interpreter's ``lmcache`` cannot talk to.

    Offers ``store(kv, tokens, cache_salt)``, ``retrieve(tokens, cache_salt)`` and
    ``close()`` like upstream's context; ``close`` also stops the child.
    """

    def __init__(self, version: str, url: str, http_url: str, model_name: str,
                 timeout: float = 30.0, kind: str = "kv") -> None:
        import tempfile

        self._workdir = Path(tempfile.mkdtemp(prefix=f"lmckvf-their-{version}-"))
        self.sdk = TheirSDK(version, url, http_url, self._workdir).start()
        try:
            self._h = self.sdk.connect(model_name, timeout, kind)
        except BaseException:
            self.close()
            raise

    def store(self, kv: torch.Tensor, tokens: list[int], cache_salt: str = "") -> bool:
        """That version's ``store``."""
        return self.sdk.store(self._h, kv, tokens, cache_salt)

    def retrieve(self, tokens: list[int], cache_salt: str = "") -> torch.Tensor | None:
        """That version's ``retrieve``."""
        return self.sdk.retrieve(self._h, tokens, cache_salt)

    def close(self) -> None:
        """Stop the child and remove its work directory. Idempotent."""
        import shutil

        self.sdk.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# The child side. Runs inside the other version's venv; imports only that lmcache.
# ------------------------------------------------------------------------------------------
def _register_hnd(url: str, http_url: str, req: dict[str, Any], keep: list[Any]) -> int:
    """Register ``NL x [2, NB, NH, BS, HS]`` CPU tensors through lmcache's transfer context.

    ``layout="NHD"`` registers ``[2, NB, BS, NH, HS]`` (random bf16) instead.

    Three API shapes exist: 0.5.1-0.5.4 ``register(iid, kv, model, ws, bic, mq_client,
    timeout, send_request, ...)``; 0.5.5 ``register(iid, kv, model, ws, bic, req_client,
    timeout, ...)``; 0.5.6 and 0.5.7 bind ``instance_id``/``req_client`` in
    ``create_transfer_context`` and take ``register(kv, model, ws, bic, timeout, ...)``.
    """
    import inspect
    import secrets
    import urllib.request

    import torch
    import zmq
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import worker_transfer as wt

    # /status has the live (0.5.7: negotiated) chunk size; /config only the flag's value
    with urllib.request.urlopen(f"{http_url}/status", timeout=10) as resp:
        chunk_size = json.loads(resp.read()).get("chunk_size")
    if chunk_size is None:  # 0.5.1 .. 0.5.5
        with urllib.request.urlopen(f"{http_url}/config", timeout=10) as resp:
            chunk_size = json.loads(resp.read())["mp"]["chunk_size"]
    chunk_size = int(chunk_size)
    nl, nh, hs = req["num_layers"], req["num_kv_heads"], req["head_size"]
    bs, nb = req["block_size"], req["num_blocks"]
    dtype = getattr(torch, req["dtype"])
    nhd = req.get("layout") == "NHD"
    shape = (2, nb, bs, nh, hs) if nhd else (2, nb, nh, bs, hs)
    kv = {f"model.layers.{i}.self_attn.attn":
          torch.randn(shape).to(dtype) if nhd else torch.zeros(shape, dtype=dtype)
          for i in range(nl)}
    hints = {"kv_layout": "NHD" if nhd else "HND"}
    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(nl)),
                              tokens_per_block=bs)]
    iid = secrets.randbits(31) + 1
    bic = chunk_size // bs
    timeout = 30.0
    zctx = zmq.Context()
    if "req_client" in inspect.signature(wt.create_transfer_context).parameters:  # 0.5.6+
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        client = RequestClientFactory.create(url, context=zctx)
        tctx = wt.create_transfer_context(kv, instance_id=iid, req_client=client,
                                          mode="lmcache_driven")
        tctx.register(kv, req["model"], 1, bic, timeout, layout_hints=hints,
                      engine_group_infos=groups)
    else:
        tctx = wt.create_transfer_context(kv, mode="lmcache_driven")
        params = inspect.signature(tctx.register).parameters
        if "send_request" in params:  # 0.5.1 .. 0.5.4
            from lmcache.integration.vllm.vllm_multi_process_adapter import send_lmcache_request
            from lmcache.v1.multiprocess.mq import MessageQueueClient

            client = MessageQueueClient(url, zctx)
            tctx.register(iid, kv, req["model"], 1, bic, client, timeout, send_lmcache_request,
                          layout_hints=hints, engine_group_infos=groups)
        else:  # 0.5.5
            from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

            client = RequestClientFactory.create(url, context=zctx)
            tctx.register(iid, kv, req["model"], 1, bic, client, timeout, layout_hints=hints,
                          engine_group_infos=groups)
    keep.append({"iid": iid, "model": req["model"], "kv": kv, "tctx": tctx, "client": client,
                 "zctx": zctx, "bic": bic, "bs": bs})
    return iid


def _lmc_store(req: dict[str, Any], keep: list[Any]) -> None:
    """``submit_store`` of registration ``req["iid"]`` (0.5.6+), then ``end_session``."""
    import secrets

    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    reg = next(k for k in keep if k["iid"] == req["iid"])
    tctx, bs = reg["tctx"], reg["bs"]
    tokens = req["tokens"]
    fields: dict[str, Any] = dict(
        model_name=reg["model"], world_size=1, worker_id=0, start=0, end=len(tokens),
        request_id=f"lmc-{secrets.token_hex(4)}", cache_salt="", num_kv_readers=1)
    if hasattr(IPCCacheServerKey, "from_token_ids"):  # 0.5.7: token_bytes keys
        key = IPCCacheServerKey.from_token_ids(token_ids=tokens, **fields)
    else:
        key = IPCCacheServerKey(token_ids=tokens, **fields)
    fut = tctx.submit_store(key.request_id, key, reg["kv"], [list(range(len(tokens) // bs))],
                            tctx.create_recorded_event(), reg["bic"])
    if fut.result(timeout=20) is None:
        raise RuntimeError("submit_store got no result")
    reg["client"].end_session(key.request_id).result(timeout=10)


def _unregister(req: dict[str, Any], keep: list[Any]) -> None:
    entry = next(k for k in keep if k["iid"] == req["iid"])
    fut = entry["tctx"].unregister()
    if fut is not None:
        fut.result(timeout=5)
    keep.remove(entry)


def _worker(url: str, http_url: str) -> int:  # pragma: no cover - runs in the child
    reply_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # lmcache logs to stdout: keep the reply channel clean
    sys.stdout = sys.stderr
    import importlib
    import importlib.metadata as md
    import traceback

    import torch

    sdk = importlib.import_module("lmcache.sdk.kvcache")
    module_api = hasattr(sdk, "store")  # 0.5.1/0.5.2: store(ctx, kv, tokens, salt)
    ctxs: dict[int, Any] = {}
    keep: list[Any] = []
    handles = itertools.count(1)

    def handle(req: dict[str, Any]) -> Any:
        cmd = req["cmd"]
        if cmd == "version":
            return md.version("lmcache")
        if cmd == "register":
            return _register_hnd(url, http_url, req, keep)
        if cmd == "lmc_store":
            return _lmc_store(req, keep)
        if cmd == "unregister":
            return _unregister(req, keep)
        if cmd == "connect":
            h = next(handles)
            mod = importlib.import_module("lmcache.sdk.qcache") \
                if req.get("kind") == "query" else sdk
            ctxs[h] = mod.connect(url, http_url, req["model"], timeout=req["timeout"])
            return h
        if cmd == "store":
            kv = torch.load(req["kv"], weights_only=True)
            ctx = ctxs[req["ctx"]]
            if module_api:
                return bool(sdk.store(ctx, kv, req["tokens"], req["salt"]))
            return bool(ctx.store(kv, req["tokens"], req["salt"]))
        if cmd == "retrieve":
            ctx = ctxs[req["ctx"]]
            if module_api:
                got = sdk.retrieve(ctx, req["tokens"], req["salt"])
            else:
                got = ctx.retrieve(req["tokens"], req["salt"])
            if got is None:
                return None
            torch.save(got.contiguous(), req["out"])
            return list(got.shape)
        if cmd == "close":
            ctx = ctxs.pop(req["ctx"])
            if module_api:
                sdk.close(ctx)
            else:
                ctx.close()
            return None
        raise ValueError(f"unknown command {cmd!r}")

    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "exit":
            break
        try:
            out = {"ok": True, "result": handle(req)}
        except BaseException as err:  # reported to the parent
            out = {"ok": False, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()}
        reply_out.write(json.dumps(out) + "\n")
    for ctx in ctxs.values():
        with contextlib.suppress(Exception):
            sdk.close(ctx) if module_api else ctx.close()
    reply_out.close()
    sys.stderr.flush()
    os._exit(0)  # skip lmcache's atexit hooks (they may block on background threads)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    sys.exit(_worker(sys.argv[2], sys.argv[3]))
