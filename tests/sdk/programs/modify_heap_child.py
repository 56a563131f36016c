"""Child of test_sdk_server.test_modify_does_not_grow_mallocs_heap: a fresh process's modify.

Reads a JSON config on stdin (server URLs, model, salt, prompts), runs one batched
modify (drop every 10th token) over streams whose KV is already stored, and prints
``HEAP {json}``: glibc's heap and mapped bytes (``mallinfo2``, all arenas) before and
after, and the result pool's counters.
"""

from __future__ import annotations

import ctypes
import json
import sys

import torch

import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast import _native


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap() -> dict[str, int]:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    return {"arena": int(m.arena), "mapped": int(m.hblkhd)}


def main() -> None:
    cfg = json.loads(sys.stdin.read())
    torch.set_num_threads(1)
    kind = lmc_sdk.LMCacheSDKCacheKind.KV
    ctx = lmc_sdk.kvcache.connect(cfg["url"], cfg["http_url"], cfg["model"])
    try:
        batch = lmc_sdk.batch.LMCacheBatchedStream(max_in_flight=2, progress=False)
        streams = []
        for p in cfg["prompts"]:
            s = lmc_sdk.request.create_request([ctx], lambda *a: iter(()), p,
                                               cache_salt=cfg["salt"])
            s._stored_upto = len(p)  # stored by the parent: no engine store to wait for
            batch.add(s)
            streams.append(s)

        def drop(tensors, toks):
            kv = tensors[kind]
            keep = [i for i in range(kv.shape[-2]) if i % 10 != 9]
            return kv.index_select(kv.dim() - 2, torch.tensor(keep)), [toks[i] for i in keep]

        before, pool0 = heap(), _native.result_pool_stats()
        report = batch.modify(drop)
        after, pool1 = heap(), _native.result_pool_stats()
        modified = report.to_dict()["metrics"]["results"]["streams_modified"]
        print("HEAP " + json.dumps({
            "before": before, "after": after, "modified": modified,
            "pool_hits": pool1["hits"] - pool0["hits"],
            "pool_misses": pool1["misses"] - pool0["misses"],
            "tokens": [len(s.tokens) for s in streams]}), flush=True)
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
