"""Read hints: a retrieve copies from where its prefix lay last time while the server
answers ``prepare_retrieve``, and keeps that copy only when the reply names the same
objects (against the real server)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import make_model, rand_tokens, run_threads, unique_model_name

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import KVLayout
from lmcache_kv_fast.protocol.types import Slot
from lmcache_kv_fast.transport.zmq_client import Channel

C = 256


def _hints(ctx) -> dict:
    return ctx._slot_hints


def _no_locks(server) -> None:
    l1 = server.status()["storage_manager"]["l1_manager"]
    assert l1["read_locked_count"] == 0 and l1["write_locked_count"] == 0


@pytest.fixture
def slow_replies(monkeypatch) -> list[int]:
    """prepare_retrieve replies look late: a hinted retrieve reads every chunk early.

    (A retrieve reads hinted chunks only until the reply is there, which on these small
    test chunks is a matter of timing.) Append to the returned list to let the reply show
    up after that many chunks instead.
    """
    after: list[int] = []
    seen = {"n": 0}

    def ready(self, call) -> bool:
        seen["n"] += 1
        return bool(after) and seen["n"] > after[0]

    monkeypatch.setattr(Channel, "ready", ready)
    return after


@contextlib.contextmanager
def _stored(server, chunks: int, seed: int, **kw: Any) -> Iterator[tuple[Any, list[int], Any]]:
    """A context on a fresh model with ``chunks`` random chunks stored; yields (ctx, toks, kv).

    Afterwards no lock may be left on an SHM server.
    """
    model = make_model(server)
    toks, kv = rand_tokens(chunks * C, seed=seed), model.kv(chunks * C, seed=seed)
    with lmc_sdk.connect(server.url, server.http_url, model.name, **kw) as ctx:
        assert ctx.store(kv, toks)
        yield ctx, toks, kv
    if ctx.transport == "shm":
        _no_locks(server)


def test_hinted_retrieve_is_exact_and_hides_nothing_wrong(server_shm, slow_replies):
    with _stored(server_shm, 3, seed=1) as (ctx, toks, kv):
        got = ctx.retrieve(toks)  # hinted by the store's slots
        assert torch.equal(got, kv)
        t = ctx.last_timing
        assert (t.hinted, t.rehinted, t.chunks) == (3, 0, 3)
        out = torch.zeros_like(kv)
        assert torch.equal(ctx.retrieve(toks, out=out), kv) and torch.equal(out, kv)
        assert ctx.last_timing.hinted == 3
        # a shorter prefix of the same tokens is its own key: first time unhinted
        assert torch.equal(ctx.retrieve(toks[: 2 * C]), kv[:, :, : 2 * C])
        assert ctx.last_timing.hinted == 0
        assert torch.equal(ctx.retrieve(toks[: 2 * C]), kv[:, :, : 2 * C])
        assert ctx.last_timing.hinted == 2


@pytest.mark.parametrize("use_out", [False, True])
def test_stale_hint_is_copied_again(server_shm, slow_replies, use_out):
    """A hint naming other objects (here: the chunks swapped) costs a second copy only."""
    with _stored(server_shm, 2, seed=2) as (ctx, toks, kv):
        (key, slots), = _hints(ctx).items()
        _hints(ctx)[key] = [slots[1], slots[0]]
        out = torch.zeros_like(kv) if use_out else None
        got = ctx.retrieve(toks, out=out)
        assert torch.equal(got, kv)
        t = ctx.last_timing
        assert (t.hinted, t.rehinted) == (0, 2)
        assert _hints(ctx)[key] == slots  # corrected from the reply
        assert torch.equal(ctx.retrieve(toks, out=out), kv)
        assert ctx.last_timing.hinted == 2


def test_hint_outside_the_pool_is_not_read(server_shm):
    with _stored(server_shm, 1, seed=3) as (ctx, toks, kv):
        (key, slots), = _hints(ctx).items()
        bad = Slot(offset=ctx._shm.segment.size + 4096, length=slots[0].length,
                   shape=slots[0].shape, dtype=slots[0].dtype)
        _hints(ctx)[key] = [bad]
        assert torch.equal(ctx.retrieve(toks), kv)
        t = ctx.last_timing
        assert (t.hinted, t.rehinted) == (0, 0)


def test_prefix_stored_again_elsewhere(server_shm, slow_replies):
    """Cleared and stored again (other bytes, maybe other slots): the new bytes come back."""
    model = make_model(server_shm)
    toks = rand_tokens(2 * C, seed=4)
    kv1, kv2, filler = model.kv(2 * C, seed=4), model.kv(2 * C, seed=5), model.kv(3 * C, seed=6)
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, model.name) as ctx:
        assert ctx.store(kv1, toks)
        assert torch.equal(ctx.retrieve(toks), kv1)
        ctx.clear()
        assert ctx.store(filler, rand_tokens(3 * C, seed=7))  # takes the freed slots first
        # another client stores the prefix: this context's hints are not updated
        with lmc_sdk.connect(server_shm.url, server_shm.http_url, model.name) as other:
            assert other.store(kv2, toks)
        got = ctx.retrieve(toks)
        assert torch.equal(got, kv2)
        t = ctx.last_timing
        assert t.hinted + t.rehinted == 2
        ctx.clear()
    _no_locks(server_shm)


@pytest.mark.parametrize("plane", ["shm, hints off", "pickle"])
def test_no_hints(request, plane):
    """``read_hints=False``, and the pickle plane (no slots): plain retrieves."""
    server = request.getfixturevalue("server_pickle" if plane == "pickle" else "server_shm")
    with _stored(server, 2, seed=8, read_hints=plane == "pickle") as (ctx, toks, kv):
        for _ in range(2):
            assert torch.equal(ctx.retrieve(toks), kv)
            assert ctx.last_timing.hinted == 0
        assert not _hints(ctx)


def test_tensor_parallel_shards_hinted(server_shm, slow_replies):
    lay = KVLayout(num_layers=3, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16)
    toks, kv = rand_tokens(2 * C, seed=10), torch.randn(2, 3, 2 * C, 512).bfloat16()
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, unique_model_name("tph"),
                         layout=lay, world_size=2) as ctx:
        assert ctx.store(kv, toks)
        assert len(_hints(ctx)) == 2  # one per shard
        k1, s1 = list(_hints(ctx).items())[1]
        _hints(ctx)[k1] = [s1[1], s1[0]]  # shard 1 stale, shard 0 right
        assert torch.equal(ctx.retrieve(toks), kv)
        t = ctx.last_timing
        assert (t.hinted, t.rehinted) == (0, 2)
        assert torch.equal(ctx.retrieve(toks), kv)
        assert ctx.last_timing.hinted == 2
    _no_locks(server_shm)


def test_hints_shared_by_threads(server_shm):
    model = make_model(server_shm)
    seqs = [(rand_tokens(2 * C, seed=20 + i), model.kv(2 * C, seed=20 + i)) for i in range(4)]
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, model.name) as ctx:
        for toks, kv in seqs:
            assert ctx.store(kv, toks)

        def run(i: int) -> None:
            for j in range(6):
                toks, kv = seqs[(i + j) % len(seqs)]
                assert torch.equal(ctx.retrieve(toks), kv)

        errors = run_threads(run, 3)
    assert not errors, errors
    _no_locks(server_shm)


def test_hints_bounded_lru(server_shm, slow_replies):
    """At most SLOT_HINTS_MAX prefixes are remembered; a prefix read again stays."""
    from lmcache_kv_fast.client.read_hints import SLOT_HINTS_MAX

    with _stored(server_shm, 1, seed=30) as (ctx, toks, kv):
        (key, slots), = _hints(ctx).items()
        for i in range(SLOT_HINTS_MAX - 1):  # fill up behind it
            ctx._remember_slots(("other", C, i, 0), slots)
        assert torch.equal(ctx.retrieve(toks), kv)  # used: moves to the young end
        assert ctx.last_timing.hinted == 1
        for i in range(SLOT_HINTS_MAX - 1, SLOT_HINTS_MAX + 9):
            ctx._remember_slots(("other", C, i, 0), slots)
        assert len(_hints(ctx)) == SLOT_HINTS_MAX
        assert key in _hints(ctx) and ("other", C, 0, 0) not in _hints(ctx)
        assert torch.equal(ctx.retrieve(toks), kv)
        assert ctx.last_timing.hinted == 1


@pytest.mark.parametrize("stale", [False, True])
def test_reply_during_the_early_reads(server_shm, slow_replies, stale):
    """The reply arrives after one early chunk: the rest come from the reply's slots."""
    slow_replies.append(1)
    with _stored(server_shm, 3, seed=40) as (ctx, toks, kv):
        (key, slots), = _hints(ctx).items()
        if stale:
            _hints(ctx)[key] = [slots[2], slots[1], slots[0]]  # chunk 1 stays right
        out = torch.zeros_like(kv)
        assert torch.equal(ctx.retrieve(toks, out=out), kv)
        t = ctx.last_timing
        assert (t.hinted, t.rehinted) == ((0, 1) if stale else (1, 0))
        assert _hints(ctx)[key] == slots


def test_real_reply_timing(server_shm):
    """Unpatched: however many chunks are read before the reply, the bytes are right."""
    with _stored(server_shm, 4, seed=41) as (ctx, toks, kv):
        out = torch.zeros_like(kv)
        for _ in range(5):
            assert torch.equal(ctx.retrieve(toks, out=out), kv)
            t = ctx.last_timing
            assert 0 <= t.hinted <= 4 and t.rehinted == 0
