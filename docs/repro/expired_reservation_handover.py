#!/usr/bin/env python3
"""Reproduce: an expired reservation's owner admits another writer's half-written buffer.

All engine-driven writers stage objects under one L1 writer tag. When writer A's
reservation of key K expires (``--l1-write-ttl-seconds``), a ``prepare_store`` of K by
writer B is handed A's staging buffer, write-locked again. A still has K in its pending
writes: when A's registration is dropped (unregister or the reaper) -- or A sends its
late ``commit_store`` -- ``finish_write(K)`` finds a write-locked staging object and admits
it, while B is still writing (here: has not written at all). Readers hit K and read bytes
that are not K's KV; B's later commit returns True as if nothing happened.

Start a server with a short write TTL, e.g.:

  lmcache server --host 127.0.0.1 --port 5555 --http-host 127.0.0.1 --http-port 8080 \\
      --chunk-size 256 --l1-size-gb 1 --supported-transfer-mode auto \\
      --shm-name repro --no-l1-use-lazy --l1-write-ttl-seconds 5

then run ``python expired_reservation_handover.py``. Exit status 1: the defect
reproduced; 0: not. Needs only pyzmq and msgspec, on the server's machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _wire import Model, Server, describe, tokens, write_slot


def main() -> int:
    """Run the reproduction; return the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="tcp://127.0.0.1:5555")
    ap.add_argument("--http-url", default="http://127.0.0.1:8080")
    ap.add_argument("--via", choices=("unregister", "commit"), default="unregister",
                    help="how writer A's stale reservation is finished")
    args = ap.parse_args()
    srv = Server(args.url, args.http_url)
    ttl = srv.config["storage_manager"]["l1_manager_config"]["write_ttl_seconds"]
    if ttl > 60:
        print(f"write TTL is {ttl}s: start the server with --l1-write-ttl-seconds 5")
        return 2
    model = Model(srv)
    a, shm_name = model.register()
    b, _ = model.register()
    reader, _ = model.register()
    toks = tokens(srv.chunk_size, seed=os.getpid())
    slots_a = model.prepare_store(a, toks, "repro-a")
    print(f"writer A reserved {len(slots_a)} slot(s) and stalls; waiting {ttl + 1}s for its "
          "write TTL to run out")
    time.sleep(ttl + 1)
    slots_b = model.prepare_store(b, toks, "repro-b")
    same = bool(slots_a and slots_b and slots_a[0]["offset"] == slots_b[0]["offset"])
    print(f"writer B reserved {len(slots_b)} slot(s) for the same tokens "
          f"({'the same buffer' if same else 'another buffer'}); B starts writing ...")
    if args.via == "unregister":
        srv.call("unregister_kv_cache_engine_driven_context", a)
        print("... when A's registration is dropped (unregister; the reaper does the same)")
    else:
        ok = srv.call("commit_store", model.key(toks, "repro-a", 0), a, b"")
        print(f"... when A's late commit_store arrives (answered {ok})")
    hit = model.lookup(toks, "repro-lookup")
    print(f"lookup by a reader while B has written nothing: {hit} chunk(s) hit")
    data = model.read_hit(reader, toks, "repro-lookup", shm_name) if hit else None
    if not hit:
        srv.call("end_session", "repro-lookup")
    if slots_b:
        write_slot(shm_name, slots_b[0], b"\x5a" * slots_b[0]["length"])
        ok = srv.call("commit_store", model.key(toks, "repro-b", 0), b, b"")
        print(f"B finished writing 0x5a and committed: commit_store answered {ok}")
        srv.call("end_session", "repro-b")
    srv.call("end_session", "repro-a")
    for iid in (a, b, reader):
        srv.call("unregister_kv_cache_engine_driven_context", iid)
    if hit:
        print(f"DEFECT: the reader got {describe(data or b'')} (not B's KV) for tokens B was "
              "still writing")
        return 1
    print("EXPECTED: nothing visible before B's commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
