"""Load: 8 threads x 500 mixed store / retrieve / lookup on one shared context, and on
four contexts at once against one server. 0 mismatches, 0 errors, and the server's
sessions, prefetch jobs, locks and staged objects are back to zero after close.

Sizes are scaled down (2 layers x 128 wide, 1-2 chunks of 256 KiB) so the op counts fit
in well under a minute on a shared 2-core box.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from conftest import Model, make_model, rand_tokens
from rel_helpers import install_frame_watch, one_frame_messages, wait_clean

import lmcache_kv_fast as lkf
from lmcache_kv_fast.testing import LMCacheServer

C = 256
THREADS = 8
OPS = 500
SEQS = 24

install_frame_watch()


@pytest.fixture(params=["shm", "pickle"])
def load_model(request: pytest.FixtureRequest) -> Iterator[Model]:
    srv: LMCacheServer = request.getfixturevalue(f"server_{request.param}")
    yield make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
    assert one_frame_messages() == []


def _run(contexts: list[lkf.LMCacheKVCacheContext], m: Model) -> tuple[Counter[str], list[str]]:
    seqs = [(rand_tokens(C * (1 + i % 2), seed=7000 + i), m.kv(C * (1 + i % 2), seed=8000 + i))
            for i in range(SEQS)]
    stored = [threading.Event() for _ in seqs]
    counts: Counter[str] = Counter()
    errors: list[str] = []
    lock = threading.Lock()

    def worker(wid: int) -> None:
        ctx = contexts[wid % len(contexts)]
        rng = random.Random(wid)
        local: Counter[str] = Counter()
        for _ in range(OPS):
            i = rng.randrange(SEQS)
            toks, kv = seqs[i]
            op = rng.choice(("store", "retrieve", "retrieve_out", "lookup"))
            was_stored = stored[i].is_set()  # before the op: a concurrent store may land
            try:
                if op == "store":
                    if ctx.store(kv, toks):
                        stored[i].set()
                    else:
                        errors.append(f"store {i} returned False without L1 pressure")
                elif op == "lookup":
                    n = ctx.lookup(toks)
                    if was_stored and n != len(toks):
                        errors.append(f"lookup {i}: {n} after a successful store")
                else:
                    out = torch.empty_like(kv) if op == "retrieve_out" else None
                    got = ctx.retrieve(toks, out=out)
                    if got is None:
                        if was_stored:
                            errors.append(f"retrieve {i}: miss after a successful store")
                    elif not torch.equal(got.view(torch.int16),
                                         kv[:, :, :got.shape[2]].view(torch.int16)):
                        errors.append(f"MISMATCH on seq {i}")
            except Exception as err:  # every failure is a finding
                errors.append(f"{op} {i}: {err!r}")
            local[op] += 1
        with lock:
            counts.update(local)

    threads = [threading.Thread(target=worker, args=(w,), name=f"load-{w}")
               for w in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a load thread hung"
    # everything stored reads back bit-exact at the end
    for i, (toks, kv) in enumerate(seqs):
        if stored[i].is_set():
            got = contexts[0].retrieve(toks)
            if got is None or not torch.equal(got.view(torch.int16), kv.view(torch.int16)):
                errors.append(f"final MISMATCH on seq {i}")
    return counts, errors


@pytest.mark.parametrize("n_contexts", [1, 4], ids=["one_context", "four_contexts"])
def test_mixed_load(load_model: Model, n_contexts: int) -> None:
    m = load_model
    srv = m.server
    contexts = [lkf.connect(srv.url, srv.http_url, m.name, timeout=30) for _ in range(n_contexts)]
    t0 = time.monotonic()
    try:
        counts, errors = _run(contexts, m)
    finally:
        for ctx in contexts:
            ctx.close()
    took = time.monotonic() - t0
    print(f"{n_contexts} context(s), {'shm' if srv.shm else 'pickle'}: {sum(counts.values())} ops "
          f"{dict(counts)} in {took:.1f}s, errors={len(errors)}")
    assert errors == []
    assert sum(counts.values()) == THREADS * OPS
    left = wait_clean(srv)
    assert not any(left.values()), left
    regs = srv.status()["non_cuda_context_meta"]
    ids = {str(i) for c in contexts for i in (c.instance_id, c.writer_instance_id)}
    assert not ids & set(regs)  # all unregistered (readers and writers)
