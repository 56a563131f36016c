#!/usr/bin/env python3
"""Reproduce: LMCache 0.5.6 admits never-written store reservations as cached KV.

A client reserves slots with ``prepare_store`` and never writes them (it died, froze or
gave up after a timeout). When its registration is dropped -- ``unregister`` or the
reaper -- the server calls ``finish_write`` on the reservation and the slots become
resident, lookup-visible objects holding whatever bytes the pool had there. Another
client then "hits" those tokens and reads bytes that are not the KV of the tokens.

Modes:
  unregister    the writer unregisters over its reservation (instant, deterministic).
  reap          the writer pinged once, then goes silent (as if SIGKILLed): reaped after
                --worker-reap-timeout-seconds, its live reservation is admitted.
  never-pinged  the writer never pinged: the reaper waits --worker-registration-grace-
                seconds; if the reservation's write TTL (--l1-write-ttl-seconds) ran out
                first, finish_write refuses it and nothing becomes visible (this is what
                lmcache-kv-fast relies on, docs/server-defects.md).

Start a server, e.g. (small timeouts so the reaper modes take about a minute):

  lmcache server --host 127.0.0.1 --port 5555 --http-host 127.0.0.1 --http-port 8080 \\
      --chunk-size 256 --l1-size-gb 1 --supported-transfer-mode auto \\
      --shm-name repro --no-l1-use-lazy --worker-reap-timeout-seconds 30 \\
      --worker-registration-grace-seconds 60 --l1-write-ttl-seconds 45

then run ``python unfilled_reservation_admitted.py --mode unregister`` (or reap,
never-pinged). Exit status 1: the defect reproduced (wrong bytes visible); 0: not.
Needs only pyzmq and msgspec, on the server's machine (it maps the SHM pool to read).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _wire import Model, Server, describe, tokens


def main() -> int:
    """Run the reproduction; return the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="tcp://127.0.0.1:5555")
    ap.add_argument("--http-url", default="http://127.0.0.1:8080")
    ap.add_argument("--mode", choices=("unregister", "reap", "never-pinged"),
                    default="unregister")
    args = ap.parse_args()
    srv = Server(args.url, args.http_url)
    mp = srv.config["mp"]
    l1cfg = srv.config["storage_manager"]["l1_manager_config"]
    reap, grace = mp["worker_reap_timeout_seconds"], mp["worker_registration_grace_seconds"]
    ttl = l1cfg["write_ttl_seconds"]
    print(f"server: chunk {srv.chunk_size}, reap timeout {reap}s, registration grace "
          f"{grace}s, write TTL {ttl}s")
    model = Model(srv)
    writer, shm_name = model.register()
    reader, _ = model.register()
    srv.call("ping", reader)
    toks = tokens(srv.chunk_size, seed=os.getpid())
    if args.mode == "reap":
        srv.call("ping", writer)  # ping-proven: judged against the reap timeout
    before = srv.l1()
    slots = model.prepare_store(writer, toks, "repro-store")
    t_prepared = time.monotonic()
    after = srv.l1()
    print(f"prepare_store reserved {len(slots)} slot(s); write_locked "
          f"{before['write_locked_count']} -> {after['write_locked_count']}; "
          "the writer never writes them")
    if args.mode == "unregister":
        srv.call("unregister_kv_cache_engine_driven_context", writer)
        print("writer unregistered")
    else:
        limit = (reap if args.mode == "reap" else grace) * 1.25 + 15
        while srv.registered(writer):
            if time.monotonic() - t_prepared > limit:
                print(f"writer still registered after {limit:.0f}s: reaping is off?")
                return 2
            srv.call("ping", reader)  # the reader stays alive
            time.sleep(1.0)
        print(f"writer reaped {time.monotonic() - t_prepared:.1f}s after its last request "
              f"(write TTL {ttl}s)")
        time.sleep(2.0)  # /status drops it before the reaper releases its transfers
    hit = model.lookup(toks, "repro-lookup")
    print(f"lookup of the never-written tokens by another instance: {hit} chunk(s) hit")
    if not hit:
        srv.call("end_session", "repro-lookup")
        print("EXPECTED: nothing visible")
        return 0
    data = model.read_hit(reader, toks, "repro-lookup", shm_name)
    print(f"DEFECT: the reader gets {describe(data or b'')} for tokens nobody stored")
    return 1


if __name__ == "__main__":
    sys.exit(main())
