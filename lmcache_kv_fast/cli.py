"""Command line: ``lmcache-kv-fast info | bench | events | demo | server``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger("lmcache_kv_fast.cli")


def _add_server_args(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument("--url", required=required, help="ZMQ URL, tcp://host:port")
    p.add_argument("--http-url", required=required, help="HTTP URL, http://host:port")


def cmd_info(args: argparse.Namespace) -> int:
    """Print what the server is and the decoded layout of each registered model."""
    from lmcache_kv_fast.errors import KVCacheSDKError
    from lmcache_kv_fast.layout import decode_status_entry
    from lmcache_kv_fast.protocol.detect import detect_generation
    from lmcache_kv_fast.transport.http import HttpInfoClient

    http = HttpInfoClient(args.http_url, 5.0)
    cfg = http.config()
    mp = cfg["mp"]
    version = http.version()
    gen, verify = detect_generation(version, mp)
    status = http.status()
    out: dict[str, Any] = {
        "server_version": version or f"{gen.name} (detected)",
        "generation": gen.name + (" (newer, unverified)" if verify else ""),
        "chunk_size": mp.get("chunk_size"),
        "supported_transfer_mode": mp.get("supported_transfer_mode"),
        "shm_name": mp.get("shm_name") or "(none: pickle plane)",
        "hash_algorithm": mp.get("hash_algorithm"),
        "models": {},
    }
    for iid, entry in (status.get("cache_context_meta") or {}).items():
        name = entry.get("model_name", "?") if isinstance(entry, dict) else "?"
        if args.model and name != args.model:
            continue
        try:
            dec = decode_status_entry(entry, int(mp["chunk_size"]))
            groups = [g.describe() for g in dec.groups]
            note = "hybrid: the SDK refuses to transfer (one group only)" if dec.is_hybrid else \
                f"chunk object {list(dec.chunk.shape)} {dec.chunk.dtype}" if dec.chunk else ""
            out["models"].setdefault(name, []).append(
                {"instance": iid, "world_size": dec.world_size, "groups": groups, "sdk": note})
        except KVCacheSDKError as err:
            out["models"].setdefault(name, []).append({"instance": iid, "error": str(err)})
    engine_driven = status.get("non_cuda_context_meta") or {}
    out["engine_driven_registrations"] = len(engine_driven)
    out["engine_driven"] = _engine_driven_models(status, args.model, set(out["models"]))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            if k not in ("models", "engine_driven"):
                print(f"{k:>26}: {v}")
        for name, e in out["engine_driven"].items():
            print(f"engine-driven model {name!r}: registrations {e['registrations']}")
            print(f"  connect() would use: {e['connect']}")
        for name, entries in out["models"].items():
            print(f"model {name!r}:")
            for e in entries:
                if "error" in e:
                    print(f"  instance {e['instance']}: cannot decode: {e['error']}")
                    continue
                print(f"  instance {e['instance']} world_size {e['world_size']}: {e['sdk']}")
                for g in e["groups"]:
                    print(f"    {g}")
    return 0


def _engine_driven_models(status: dict[str, Any], only: str | None,
                          with_vllm: set[str]) -> dict[str, dict[str, Any]]:
    """Per model registered only engine-driven: its registrations and what connect() resolves.

    A CPU vLLM engine and every SDK context register that way (``non_cuda_context_meta``);
    this process has no context of its own, so every entry counts (see
    ``layout/engine_resolve.py`` for how the engine's entry is told from SDKs').
    """
    from lmcache_kv_fast.errors import KVCacheSDKError
    from lmcache_kv_fast.layout import resolve_engine_layout

    meta = status.get("non_cuda_context_meta") or {}
    names = sorted({e.get("model_name") for e in meta.values()
                    if isinstance(e, dict) and isinstance(e.get("model_name"), str)})
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if (only and name != only) or name in with_vllm:
            continue
        regs = {iid: {k: v for k, v in e.items() if k != "model_name"}
                for iid, e in meta.items() if isinstance(e, dict) and e.get("model_name") == name}
        try:
            what = resolve_engine_layout(status, name).describe()
        except KVCacheSDKError as err:
            what = f"cannot resolve: {err}"
        out[name] = {"registrations": regs, "connect": what}
    return out


@contextlib.contextmanager
def _local_server(args: argparse.Namespace, *, l1_gb: float = 2.0):
    """Yield (url, http_url): the given server, or a local real one started here."""
    if args.url and args.http_url:
        yield args.url, args.http_url
        return
    from lmcache_kv_fast.testing import LMCacheServer

    with LMCacheServer(shm=not getattr(args, "pickle", False), l1_size_gb=l1_gb) as srv:
        logger.info("started a local LMCache server: %s %s", srv.url, srv.http_url)
        yield srv.url, srv.http_url


def cmd_demo(args: argparse.Namespace) -> int:
    """Token dropping over a batch of sequences against a (local) real server."""
    import lmcache_kv_fast as lkf
    from lmcache_kv_fast.demo import run_batch_demo
    from lmcache_kv_fast.testing import register_vllm_layout

    seq_bytes = 2 * args.layers * args.tokens * 1024 * 2
    with _local_server(args, l1_gb=max(2.0, 3 * args.sequences * seq_bytes / 2**30)) as (url, http):
        if not (args.url and args.http_url):
            register_vllm_layout(url, args.model, num_layers=args.layers, num_kv_heads=8,
                                 head_size=128)
        with lkf.connect(url, http, args.model) as ctx:
            print(f"connected: {ctx!r}, backend {lkf.backend()}, server {ctx.server_version}")
            rep = run_batch_demo(ctx, sequences=args.sequences, tokens=args.tokens, k=args.k,
                                 progress=not args.no_progress)
            print(f"token dropping (every {args.k}th token) over {args.sequences} sequences "
                  f"x {args.tokens} tokens:")
            print("  " + rep.summary())
            return 0 if rep.failed == 0 else 1


def cmd_server(args: argparse.Namespace) -> int:
    """Start a local real LMCache server and keep it running until Ctrl-C."""
    from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout

    with LMCacheServer(shm=not args.pickle, l1_size_gb=args.l1_size_gb,
                       chunk_size=args.chunk_size, keep_log=True,
                       malloc_tuning=not args.no_malloc_tuning) as srv:
        if args.register:
            register_vllm_layout(srv.url, args.register, num_layers=args.layers, num_kv_heads=8,
                                 head_size=128)
        print(json.dumps({"url": srv.url, "http_url": srv.http_url,
                          "shm": srv.pool_segment or None, "log": str(srv.log_path),
                          "env": srv.server_env}), flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    return 0


def _checkout_root() -> Path | None:
    """The source checkout this package runs from (an editable install), if any."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "benches" / "harness" / "cli.py").is_file() else None


def cmd_bench(argv: list[str]) -> int:
    """Run the benchmark harness of the checkout (it is not part of the wheel)."""
    try:
        from benches.harness.cli import main as bench_main
    except ImportError:
        root = _checkout_root()
        if root is None:
            logger.error("the benchmark is not installed with the package: it runs from a "
                         "source checkout (git clone the project, then ./scripts/run.sh bench "
                         "or make bench)")
            return 2
        sys.path.insert(0, str(root))
        from benches.harness.cli import main as bench_main
    return bench_main(argv)


def cmd_events(argv: list[str]) -> int:
    """Delegate to the KV-events publisher."""
    from lmcache_kv_fast.events.command import events_main

    return events_main(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lmcache-kv-fast`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "events":
        return cmd_events(argv[1:])
    ap = argparse.ArgumentParser(prog="lmcache-kv-fast", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="describe a server and its registered models")
    _add_server_args(p, required=False)
    p.add_argument("--model", help="only this model")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("demo", help="token dropping over a batch against a (local) real server")
    _add_server_args(p)
    p.add_argument("--model", default="demo/llama-like")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--pickle", action="store_true", help="local server without SHM")
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("server", help="run a local real LMCache server until Ctrl-C")
    p.add_argument("--pickle", action="store_true")
    p.add_argument("--l1-size-gb", type=float, default=4.0)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--register", metavar="MODEL", help="register a vLLM-like layout for MODEL")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="run the server with glibc's default allocator settings (by default "
                        "it gets MALLOC_ARENA_MAX=1 and a 512 MiB mmap threshold, which keep "
                        "pickle-plane request buffers in a reused heap: docs/deployment.md)")
    sub.add_parser("bench", help="benchmark every copy path (see: bench --help)")
    sub.add_parser("events", help="publish KV events in vLLM's format (see: events --help)")
    args = ap.parse_args(argv)
    if args.cmd == "info" and not args.http_url:
        ap.error("info needs --http-url")
    return {"info": cmd_info, "demo": cmd_demo, "server": cmd_server}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
