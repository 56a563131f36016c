"""Distributed rewrite / store / retrieve on a real 3-node Ray cluster and 3 real servers."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import Model, rand_tokens
from fleet_env import FleetEnv, fleet_env  # noqa: F401 - the fixture
from fleet_helpers import drop_every_4th, drop_every_4th_alloc, whole
from lmcache_kv_fast import batch, connect
from lmcache_kv_fast.distributed import Fleet, FleetReport, rewrite

pytestmark = pytest.mark.distributed

CONNECT = {"timeout": 20.0}


def _ctxs(models: list[Model]):
    return [connect(m.server.url, m.server.http_url, m.name, timeout=20.0) for m in models]


def _seed(models: list[Model], per_server: int, chunks: int, base: int):
    """Store distinct sequences on each server; returns ({server: [tokens]}, {seq_id: kv})."""
    c = models[0].server.chunk_size
    owned: dict[int, list[list[int]]] = {}
    kvs: dict[tuple[int, ...], torch.Tensor] = {}
    ctxs = _ctxs(models)
    try:
        for i, (m, ctx) in enumerate(zip(models, ctxs)):
            owned[i] = []
            for k in range(per_server):
                toks = rand_tokens(chunks * c + 17, seed=base + 100 * i + k)
                kv = m.kv(len(toks), seed=base + 100 * i + k)
                assert ctx.store(kv, toks)
                owned[i].append(toks)
                kvs[tuple(toks)] = kv
    finally:
        for ctx in ctxs:
            ctx.close()
    return owned, kvs


def test_rewrite_equals_single_process_batch_per_server(fleet_env: FleetEnv):
    dist = fleet_env.models("dist")
    local = fleet_env.models("local")
    owned, _ = _seed(dist, per_server=3, chunks=3, base=1000)
    owned_l, _ = _seed(local, per_server=3, chunks=3, base=1000)
    assert owned == owned_l
    c = dist[0].server.chunk_size
    nowhere = rand_tokens(2 * c, seed=99)
    seqs = [t for i in range(3) for t in owned[i]]
    seqs.insert(4, nowhere)
    specs = fleet_env.specs()
    rep = rewrite(specs, dist[0].name, seqs, drop_every_4th_alloc, progress=False,
                  connect_kwargs=CONNECT)
    assert isinstance(rep, FleetReport)
    assert (rep.items, rep.ok, rep.missed, rep.failed) == (10, 9, 1, 0), rep.summary()
    [err] = rep.errors
    assert (err.index, err.stage, err.server) == (4, "route", None)
    assert "cached on no server" in err.reason
    ctxs = _ctxs(local)
    try:
        for i, ctx in enumerate(ctxs):
            lrep = batch.rewrite(ctx, owned[i], drop_every_4th, progress=False)
            prep = rep.per_server[specs[i].name]
            assert (prep.items, prep.ok, prep.missed, prep.failed) == \
                (lrep.items, lrep.ok, lrep.missed, lrep.failed)
            assert prep.tokens_moved == lrep.tokens_moved
            assert prep.bytes_moved == lrep.bytes_moved
    finally:
        for ctx in ctxs:
            ctx.close()
    # routing: every sequence ran on its owner
    for k, toks in enumerate(seqs):
        if toks is nowhere:
            assert rep.routes[k] is None
        else:
            owner = next(i for i in range(3) if toks in owned[i])
            assert rep.routes[k] == specs[owner].name
    # the stored outputs are byte-identical to the single-process rewrite's
    dctx, lctx = _ctxs(dist), _ctxs(local)
    try:
        for i in range(3):
            for toks in owned[i]:
                new = whole(drop_every_4th(torch.zeros(1, len(toks), 1), toks)[1], c)
                a = dctx[i].retrieve(new)
                b = lctx[i].retrieve(new)
                assert a is not None and b is not None and a.shape[-2] == len(new)
                assert torch.equal(a, b)
                for j in range(3):  # and nowhere else
                    if j != i:
                        assert dctx[j].lookup(new) == 0
    finally:
        for ctx in dctx + lctx:
            ctx.close()
