"""``lmcache-kv-fast events``: republish an MP server's KV events in vLLM's wire format.

Only :mod:`lmcache_kv_fast.cli` (and the deferred ``events_main`` of the package) import
this module; it sits on top of :mod:`lmcache_kv_fast.events.publisher`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.events.publisher import DEFAULT_PUBLISH, DEFAULT_TOPIC, KVEventPublisher
from lmcache_kv_fast.events.vllm_format import VllmKVEventBatch
from lmcache_kv_fast.protocol.constants import MAX_EVENTS_PER_BATCH

logger = logging.getLogger("lmcache_kv_fast.events")


def _print_batch(seq: int, batch: VllmKVEventBatch) -> None:
    """Write a batch to stdout (the command's ``--print`` output) like vLLM's subscriber example."""
    lines = [f"Received event batch at {batch.ts} (seq {seq}):", *(f"  - {ev}" for ev in batch.events)]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-kv-fast events",
        description="Republish the KV events of an LMCache MP server (0.5.6+) in vLLM's "
                    "KV-events ZMQ format (PUB, optional ROUTER replay).",
    )
    p.add_argument("--url", required=True, help="server ZMQ URL, tcp://host:port")
    p.add_argument("--http-url", required=True, help="server HTTP URL, http://host:port")
    p.add_argument("--model", required=True, help="model name whose events to publish")
    p.add_argument("--publish", default=DEFAULT_PUBLISH, help="PUB endpoint to bind "
                   f"(default {DEFAULT_PUBLISH})")
    p.add_argument("--topic", default=DEFAULT_TOPIC, help=f"topic (default {DEFAULT_TOPIC})")
    p.add_argument("--replay", default=None, help="ROUTER replay endpoint to bind, e.g. "
                   "tcp://127.0.0.1:5558")
    p.add_argument("--print", action="store_true", dest="print_events",
                   help="also show every published batch on the terminal")
    p.add_argument("--cursor", type=int, default=0, help="server cursor to start from "
                   "(default 0: replay the retained log)")
    p.add_argument("--max-events", type=int, default=MAX_EVENTS_PER_BATCH,
                   help="records per server batch, 1..1024")
    p.add_argument("--wire-format", choices=("array", "map"), default="array",
                   help="array: vLLM <= 0.23 positional structs (default); map: events as "
                        "tagged maps (newer vLLM)")
    p.add_argument("--int-block-hashes", action="store_true",
                   help="publish hashes as 64-bit ints (vLLM VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)")
    p.add_argument("--timeout", type=float, default=10.0, help="probe timeout in seconds")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def events_main(argv: list[str]) -> int:
    """``lmcache-kv-fast events``: publish a server's KV events until Ctrl-C / SIGTERM.

    Args:
        argv: Arguments after ``events``.

    Returns:
        0 after a clean stop, 1 when the server cannot be used, 2 for bad arguments.
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        pub = KVEventPublisher(
            args.url, http_url=args.http_url, model_name=args.model, publish=args.publish,
            topic=args.topic, replay=args.replay, cursor=args.cursor,
            max_events=args.max_events, timeout=args.timeout, wire_format=args.wire_format,
            int_block_hashes=args.int_block_hashes, announce_local=False,
            on_publish=_print_batch if args.print_events else None,
        )
    except InvalidArgumentError as err:
        logger.error("%s", err)
        return 2
    except KVCacheSDKError as err:
        logger.error("%s", err)
        return 1
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: pub.stop())
    try:
        pub.run()
    except KeyboardInterrupt:
        pass
    finally:
        pub.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
