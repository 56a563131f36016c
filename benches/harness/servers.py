"""The servers a run uses (started here unless given), their models, and the machine."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .helpers import http_json
from .sizes import HEAD_SIZE, KV_HEADS, SHM_POOL_PREFIX, GiB, Sizes, pickle_l1_gib, shm_l1_gib

logger = logging.getLogger("benches.harness")


@dataclass
class Server:
    """One server of the run (its ``asdict`` goes into the JSON)."""

    url: str
    http_url: str
    l1_gib: float
    segment: str = ""
    models: dict[str, str] = field(default_factory=dict)
    version: str | None = None
    #: glibc settings the harness gave a server it started ("" values: none; None: a
    #: server given by URL, unknown)
    malloc: dict[str, str] | None = None


def describe_server(url: str, http_url: str, l1_gib: float) -> Server:
    """A server from its ``/config`` (its L1 pool segment, if on this machine) and version."""
    mp = http_json(http_url, "/config").get("mp", {})
    name = str(mp.get("shm_name") or "").lstrip("/")
    seg = ""
    if name:
        seg = f"/dev/shm/{name if name.startswith(SHM_POOL_PREFIX) else SHM_POOL_PREFIX + name}"
    try:
        version = http_json(http_url, "/version")
    except Exception:
        version = None
    return Server(url, http_url, l1_gib, seg if os.path.exists(seg) else "", version=version)


@contextlib.contextmanager
def servers(args: argparse.Namespace, s: Sizes, workloads: Sequence[str],
            notes: list[str]) -> Iterator[tuple[Server, Server | None]]:
    """Yield the SHM server and the pickle server (started here unless given)."""
    from lmcache_kv_fast.testing import LMCacheServer

    shm_gib = args.l1_gb or shm_l1_gib(s, workloads)
    pick_gib = args.pickle_l1_gb or pickle_l1_gib(s)
    want_pickle = any(w in workloads for w in ("W2", "W4"))
    with contextlib.ExitStack() as stack:
        started: dict[str, LMCacheServer] = {}
        errors: list[BaseException] = []

        def start(key: str, srv: LMCacheServer) -> None:
            try:
                srv.start()
                started[key] = srv
            except BaseException as err:
                errors.append(err)
                srv.stop()

        threads = []
        py = {"python": server_python(args), "version": args.server_version,
              "transport": getattr(args, "transport", "zmq")}
        if not (args.url and args.http_url):
            srv = LMCacheServer(shm=True, l1_size_gb=shm_gib, chunk_size=args.chunk_size,
                                malloc_tuning=args.server_malloc == "tuned", **py)
            stack.callback(srv.stop)
            threads.append(threading.Thread(target=start, args=("shm", srv)))
        if want_pickle and not (args.pickle_url and args.pickle_http_url):
            psrv = LMCacheServer(shm=False, l1_size_gb=pick_gib, chunk_size=args.chunk_size,
                                 malloc_tuning=args.server_malloc == "tuned", **py)
            stack.callback(psrv.stop)
            threads.append(threading.Thread(target=start, args=("pickle", psrv)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

        def malloc_of(srv: LMCacheServer) -> dict[str, str]:
            return {k: v for k, v in srv.server_env.items() if k.startswith("MALLOC_")}

        if "shm" in started:
            shm = describe_server(started["shm"].url, started["shm"].http_url, shm_gib)
            shm.malloc = malloc_of(started["shm"])
        else:
            shm = describe_server(args.url, args.http_url, shm_gib)
            notes.append(f"using the given server {args.url} (its L1 is assumed to be "
                         f"{shm_gib:g} GiB; it is cleared between workloads)")
        if not shm.segment:
            notes.append("the SHM server's pool segment is not on this machine: W1 cold "
                         "stores are not measured")
        pick = None
        if "pickle" in started:
            pick = describe_server(started["pickle"].url, started["pickle"].http_url, pick_gib)
            pick.malloc = malloc_of(started["pickle"])
        elif want_pickle:
            pick = describe_server(args.pickle_url, args.pickle_http_url, pick_gib)
        yield shm, pick


def server_python(args: argparse.Namespace) -> str | None:
    """The interpreter of ``--server-version``'s venv (None: this one's lmcache).

    Raises:
        SystemExit: That version has no venv (the message says how to make one).
    """
    if not getattr(args, "server_version", None):
        return None
    from testbed.compat import missing_venv_hint, venv_python

    py = venv_python(args.server_version)
    if py is None:
        raise SystemExit(missing_venv_hint(args.server_version))
    return py


def _geometry(spec: int | tuple[int, int, int]) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_size)``: a bare layer count has the bench's 8 x 128 heads."""
    return (spec, KV_HEADS, HEAD_SIZE) if isinstance(spec, int) else spec


def register_models(srv: Server, which: dict[str, int | tuple[int, int, int]],
                    stack: contextlib.ExitStack, lmcache_version: str | None = None) -> None:
    """Register a vLLM-like layout on ``srv`` per ``{key: layers}`` (unregistered by ``stack``).

    A value is a layer count (8 KV heads x 128) or ``(layers, kv_heads, head_size)``.
    Over gRPC the registration is made by the server version's own client in a child
    (``register_vllm_layout`` speaks ZMQ); ``lmcache_version`` names it (None: 0.5.6).
    """
    from lmcache_kv_fast.protocol.ops import NEWEST, generation_for
    from lmcache_kv_fast.testing import register_vllm_layout

    if srv.url.startswith("grpc"):
        _register_with_their_client(srv, which, stack, lmcache_version or "0.5.6")
        return
    gen = generation_for(srv.version or "") or NEWEST
    for key, spec in which.items():
        layers, heads, size = _geometry(spec)
        name = f"bench-{key}-L{layers}-{os.getpid()}"
        reg = register_vllm_layout(srv.url, name, num_layers=layers, num_kv_heads=heads,
                                   head_size=size, generation=gen)
        stack.callback(_quiet, reg.unregister)
        srv.models[key] = name


def _register_with_their_client(srv: Server, which: dict[str, int | tuple[int, int, int]],
                                stack: contextlib.ExitStack, version: str) -> None:
    import tempfile

    from testbed.compat import TheirSDK

    workdir = tempfile.mkdtemp(prefix="lmckvf-bench-reg-")
    theirs = TheirSDK(version, srv.url, srv.http_url, workdir).start()
    stack.callback(_quiet, theirs.stop)  # after the unregistrations below (LIFO)
    for key, spec in which.items():
        layers, heads, size = _geometry(spec)
        name = f"bench-{key}-L{layers}-{os.getpid()}"
        iid = theirs.register_hnd(name, num_layers=layers, num_kv_heads=heads,
                                  head_size=size)
        stack.callback(_quiet, lambda iid=iid: theirs.unregister(iid))
        srv.models[key] = name


def _quiet(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as err:
        logger.debug("cleanup failed: %s", err)


def machine_description() -> dict[str, Any]:
    """Cores, memory, CPU, THP and versions (python / torch / lmcache / lmcache-kv-fast)."""
    from importlib import metadata

    def ver(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    d: dict[str, Any] = {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": ver("torch"),
        "lmcache": ver("lmcache"),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                d["memory_gib"] = round(int(line.split()[1]) * 1024 / GiB, 1)
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                d["cpu"] = line.split(":", 1)[1].strip()
                break
        d["thp"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        d["dev_shm_gib"] = round(st.f_blocks * st.f_frsize / GiB, 1)
    try:
        import lmcache_kv_fast

        d["lmcache_kv_fast"] = lmcache_kv_fast.__version__
        d["default_backend"] = lmcache_kv_fast.backend()
    except Exception as err:  # the harness still runs the paths that work
        d["lmcache_kv_fast"] = f"unavailable: {err!r}"
    return d
