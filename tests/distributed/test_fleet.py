"""Distributed rewrite / store / retrieve on a real 3-node Ray cluster and 3 real servers.

One cluster and three SHM servers (one per node) for the whole module (``env``); each
test uses its own model name, so tests do not see each other's KV.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from conftest import Model, rand_tokens
from fleet_env import (  # noqa: F401 - fleet_env_fixture provides the `env` fixture
    WRITE_TTL,
    CommitTrap,
    FleetEnv,
    fleet_env_fixture,
    wait_unlocked,
)
from fleet_helpers import SlowDrop, drop_every_4th, drop_every_4th_alloc, whole
from lmc_writer import LmcDrivenWriter

from lmcache_kv_fast import batch, connect
from lmcache_kv_fast.distributed import (
    Fleet,
    FleetReport,
    KVEventsIndex,
    Server,
    retrieve_many,
    rewrite,
    rewrite_dataset,
)
from lmcache_kv_fast.testing.server import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CONNECT = {"timeout": 20.0}


def _ctxs(models: list[Model], **kw):
    return [connect(m.server.url, m.server.http_url, m.name, timeout=20.0, **kw) for m in models]


def _seed(models: list[Model], per_server: int, chunks: int, base: int):
    """Store distinct sequences on each server; returns ``({server: [tokens]}, {tokens: kv})``."""
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


def _check_outputs(models: list[Model], owned: dict[int, list[list[int]]],
                   kvs: dict[tuple[int, ...], torch.Tensor]) -> None:
    """Each owner holds exactly ``drop_every_4th`` of its sequences' KV (whole chunks)."""
    c = models[0].server.chunk_size
    ctxs = _ctxs(models)
    try:
        for i, seqs in owned.items():
            for toks in seqs:
                hit = len(toks) // c * c
                want_kv, new = drop_every_4th(kvs[tuple(toks)][..., :hit, :], toks[:hit])
                new = whole(new, c)
                got = ctxs[i].retrieve(new)
                assert got is not None and got.shape[-2] == len(new), (i, len(new))
                assert torch.equal(got, want_kv[..., : len(new), :])
    finally:
        for ctx in ctxs:
            ctx.close()


def _registered(server) -> set[str]:
    return {str(i) for i in server.status().get("registered_non_cuda_instance_ids", [])}


def _all_unlocked(env: FleetEnv, timeout: float = WRITE_TTL + 4) -> None:
    for s in env.servers:
        assert not any(wait_unlocked(s, timeout).values()), (s.url, wait_unlocked(s, 0))


# ---------------------------------------------------------------------- results, routing
def test_rewrite_equals_single_process_batch_per_server(env: FleetEnv):
    dist, local = env.models("dist"), env.models("local")
    owned, kvs = _seed(dist, per_server=3, chunks=3, base=1000)
    owned_l, _ = _seed(local, per_server=3, chunks=3, base=1000)
    assert owned == owned_l
    c = dist[0].server.chunk_size
    nowhere = rand_tokens(2 * c, seed=99)
    seqs = [t for i in range(3) for t in owned[i]]
    seqs.insert(4, nowhere)
    specs = env.specs()
    rep = rewrite(specs, dist[0].name, seqs, drop_every_4th_alloc, progress=True,
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
            assert (prep.tokens_moved, prep.bytes_moved) == (lrep.tokens_moved, lrep.bytes_moved)
    finally:
        for ctx in ctxs:
            ctx.close()
    assert rep.tokens_moved == sum(p.tokens_moved for p in rep.per_server.values())
    # routing: every sequence ran on its owner, and only there
    for k, toks in enumerate(seqs):
        owner = next((i for i in range(3) if toks in owned[i]), None)
        assert rep.routes[k] == (None if owner is None else specs[owner].name)
    # the stored outputs are byte-identical to the single-process rewrite's
    dctx, lctx = _ctxs(dist), _ctxs(local)
    try:
        for i in range(3):
            for toks in owned[i]:
                new = whole(drop_every_4th(torch.zeros(1, len(toks), 1), toks)[1], c)
                a, b = dctx[i].retrieve(new), lctx[i].retrieve(new)
                assert a is not None and b is not None and a.shape[-2] == len(new)
                assert torch.equal(a, b)
                assert all(dctx[j].lookup(new) == 0 for j in range(3) if j != i)
    finally:
        for ctx in dctx + lctx:
            ctx.close()
    _check_outputs(dist, owned, kvs)
    assert "srv1" in rep.summary() and "9 ok" in rep.summary()


def test_route_function_longest_prefix_and_store_retrieve(env: FleetEnv):
    models = env.models("route")
    c = models[0].server.chunk_size
    specs = env.specs()
    seqs = [rand_tokens(2 * c + 5, seed=2000 + k) for k in range(6)]
    kvs = [models[0].kv(len(t), seed=k) for k, t in enumerate(seqs)]
    with Fleet(specs, models[0].name, connect_kwargs=CONNECT) as fleet:
        iids = [s.info["instance_id"] for s in fleet.slots]
        assert all(str(i) in _registered(env.servers[k]) for k, i in enumerate(iids))
        # a route function: item k -> server k % 3 (by index, by name, by Server)
        answers = [0, "srv1", specs[2], 0, "srv1", specs[2]]
        rep = fleet.store_many(list(zip(kvs, seqs)), route=lambda t: answers[seqs.index(t)])
        assert (rep.ok, rep.failed) == (6, 0), rep.summary()
        assert [rep.routes[k] for k in range(6)] == [specs[k % 3].name for k in range(6)]
        # server 2 gets seqs[0]'s two chunks plus a third: lookups pick the longest prefix,
        # ties go to the first server
        longer = seqs[0][: 2 * c] + rand_tokens(c, seed=77)
        kv_longer = models[0].kv(3 * c, seed=5)
        assert fleet.store_many([(kv_longer, longer)], route=lambda t: 2).ok == 1
        assert fleet.lookup([seqs[0], longer]) == [[2 * c, 0, 2 * c], [2 * c, 0, 3 * c]]
        lrep = FleetReport()
        got = dict(fleet.retrieve_many([seqs[0], longer], report=lrep))
        assert lrep.routes == {0: "srv0", 1: "srv2"}
        assert torch.equal(got[0], kvs[0][..., : 2 * c, :]) and torch.equal(got[1], kv_longer)
        got = dict(fleet.retrieve_many([*seqs, rand_tokens(c, seed=3)], progress=False))
        assert set(got) == set(range(7)) and got[6] is None
        for k in range(6):
            assert torch.equal(got[k], kvs[k][..., : 2 * c, :])
        # store_many with lookups: cached nowhere -> a deterministic home, not missed
        fresh = [rand_tokens(c, seed=3000 + k) for k in range(4)]
        srep = fleet.store_many([(models[0].kv(c, seed=k), t) for k, t in enumerate(fresh)])
        assert srep.ok == 4 and all(srep.routes[k] is not None for k in range(4))
        srep2 = fleet.store_many([(models[0].kv(c, seed=k), t) for k, t in enumerate(fresh)])
        assert srep2.routes == srep.routes
        # bad items are reported, not raised
        bad = fleet.store_many([("nope", seqs[0]), 5], route=lambda t: 0)
        assert bad.failed == 2 and {e.stage for e in bad.errors} == {"store"}
        with pytest.raises(ValueError, match="route"):
            fleet.rewrite(seqs, drop_every_4th, route="nearest")
        rrep = fleet.rewrite(seqs, drop_every_4th, route=lambda t: 99, progress=False)
        assert rrep.failed == 6 and all(e.stage == "route" and "index 99" in e.reason
                                        for e in rrep.errors)
    # closing the fleet unregistered every actor's context
    assert not any(str(i) in _registered(env.servers[k]) for k, i in enumerate(iids))
    # the one-call form
    [(i, kv)] = list(retrieve_many(specs, models[0].name, [seqs[1]], connect_kwargs=CONNECT))
    assert i == 0 and torch.equal(kv, kvs[1][..., : 2 * c, :])


# ---------------------------------------------------------------------- faults
def test_an_actor_dead_before_close_leaves_no_reader_registered(env: FleetEnv):
    """close() unregisters the reader of an actor that died without closing its context."""
    models = env.models("deadclose")
    specs = env.specs()
    fleet = Fleet(specs, models[0].name, connect_kwargs=CONNECT)
    try:
        iids = [s.info["instance_id"] for s in fleet.slots]
        assert all(str(i) in _registered(env.servers[k]) for k, i in enumerate(iids))
        ray.kill(fleet.slots[1].handle, no_restart=True)  # dies holding its registration
        time.sleep(0.5)
    finally:
        fleet.close(timeout=10.0)
    assert not any(str(i) in _registered(env.servers[k]) for k, i in enumerate(iids))


def test_killing_an_actor_mid_batch_loses_nothing(env: FleetEnv):
    models = env.models("kill")
    owned, kvs = _seed(models, per_server=4, chunks=2, base=4000)
    seqs = [t for i in range(3) for t in owned[i]]
    killed: list[int] = []
    with Fleet(env.specs(), models[0].name, max_in_flight=2, connect_kwargs=CONNECT) as fleet:
        pid = fleet.slots[1].info["pid"]
        first_iid = fleet.slots[1].info["instance_id"]

        def on_result(index: int, server: str | None, status: str) -> None:
            if server == "srv1" and not killed:
                killed.append(index)
                ray.kill(fleet.actor("srv1"), no_restart=False)  # items are in flight

        rep = fleet.rewrite(seqs, SlowDrop(0.3), on_result=on_result, progress=False)
        assert fleet.slots[1].info["pid"] != pid  # Ray restarted it
        iids = [first_iid, *(s.info["instance_id"] for s in fleet.slots)]
    # the killed actor's context and the live ones: none is left registered after close
    assert not any(str(i) in _registered(env.servers[k]) for k, i in zip([1, 0, 1, 2], iids))
    assert killed and rep.actors_lost == 1 and rep.retried >= 1, rep.summary()
    assert (rep.items, rep.ok, rep.failed, rep.missed) == (12, 12, 0, 0), rep.summary()
    assert rep.per_server["srv1"].ok == 4
    _check_outputs(models, owned, kvs)
    _all_unlocked(env)


def test_actors_lost_between_store_and_commit(env: FleetEnv):
    """The worst moments, one per server: on srv1 the store's slots are prepared and filled
    but the commit never reaches the server; on srv2 the commit lands but its reply never
    reaches the actor. Both actors are killed right there."""
    models = env.models("trap")
    owned, kvs = _seed(models, per_server=3, chunks=2, base=5000)
    seqs = [t for i in range(3) for t in owned[i]]
    traps = {1: CommitTrap(env.servers[1].url, "request"), 2: CommitTrap(env.servers[2].url, "reply")}
    specs = env.specs()
    for i, trap in traps.items():
        specs[i] = Server(trap.url, specs[i].http_url, node=specs[i].node, name=f"srv{i}")
    try:
        with Fleet(specs, models[0].name, max_in_flight=1, connect_kwargs=CONNECT) as fleet:
            for i, trap in traps.items():
                trap.on_trap = lambda name=f"srv{i}": ray.kill(fleet.actor(name), no_restart=False)

            def on_result(index: int, server: str | None, status: str) -> None:
                if server in ("srv1", "srv2"):
                    traps[int(server[-1])].arm()  # the server's next store is lost with its actor

            t0 = time.monotonic()
            rep = fleet.rewrite(seqs, drop_every_4th, on_result=on_result, progress=False)
            took = time.monotonic() - t0
    finally:
        for trap in traps.values():
            trap.close()
    assert all(t.fired.is_set() for t in traps.values())
    assert (rep.ok, rep.failed, rep.actors_lost) == (9, 0, 2), rep.summary()
    # srv1: the lost attempt's prepared slots block its chunks until the write TTL, so the
    # retry is held back until then (unless the restart itself took that long)
    assert rep.deferred == 1 or took > WRITE_TTL, rep.summary()
    # srv2: the store had landed; the retry found its output cached and compared it
    assert rep.per_server["srv2"].stage_seconds.get("verify", 0) > 0, rep.summary()
    assert "verify" not in rep.per_server["srv0"].stage_seconds
    _check_outputs(models, owned, kvs)
    _all_unlocked(env)


def test_node_lost_mid_batch_runs_on_a_new_actor(env: FleetEnv):
    node, extra = env.spare_node, env.spare_node_id
    models = env.models("node")
    owned, kvs = _seed(models, per_server=3, chunks=2, base=6000)
    seqs = [t for i in range(3) for t in owned[i]]
    specs = env.specs()
    specs[2] = Server(specs[2].url, specs[2].http_url, node=extra, name="srv2")
    removed: list[bool] = []
    with Fleet(specs, models[0].name, max_in_flight=2, connect_kwargs=CONNECT) as fleet:
        assert fleet.slots[2].info["node_id"] == extra

        def on_result(index: int, server: str | None, status: str) -> None:
            if server == "srv2" and not removed:
                removed.append(True)
                env.cluster.remove_node(node)

        rep = fleet.rewrite(seqs, SlowDrop(0.3), on_result=on_result, progress=False)
        assert fleet.slots[2].info["node_id"] != extra
    assert removed and (rep.ok, rep.failed) == (9, 0), rep.summary()
    assert rep.actors_lost == 1 and rep.actors_replaced == 1, rep.summary()
    _check_outputs(models, owned, kvs)
    _all_unlocked(env)


def test_server_gone_is_reported_naming_it(env: FleetEnv):
    models = env.models("gone")
    owned, _ = _seed(models[:1], per_server=3, chunks=2, base=7000)
    extra = env.spare
    from conftest import make_model

    make_model(extra, num_layers=2, num_kv_heads=2, head_size=64, name=models[0].name)
    ghost = Server(f"tcp://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}",
                   node=env.node_ids[0], name="ghost")
    doomed = Server(extra.url, extra.http_url, node=env.node_ids[0], name="doomed")
    specs = [env.specs()[0], ghost, doomed]
    seqs = owned[0]  # cached on srv0
    target = {0: 0, 1: 1, 2: 2}  # item 1 -> ghost, item 2 -> doomed
    with Fleet(specs, models[0].name, connect_kwargs={"timeout": 3.0}) as fleet:
        assert [s.state for s in fleet.slots] == ["up", "down", "up"]
        extra.stop()  # this server dies before the batch
        rep = fleet.rewrite(seqs, drop_every_4th, route=lambda t: target[seqs.index(t)],
                            progress=False)
    assert (rep.ok, rep.failed) == (1, 2), rep.summary()
    errs = {e.index: e for e in rep.errors}
    assert (errs[1].server, errs[1].stage) == ("ghost", "server")
    assert "could not start" in errs[1].reason
    assert errs[2].server == "doomed" and errs[2].stage in ("retrieve", "server")
    assert set(rep.servers_down) == {"ghost", "doomed"}, rep.summary()
    assert "ghost" in rep.summary()


# ---------------------------------------------------------------------- events index
def test_events_index_routes_engine_stores_and_learns_fleet_stores(env: FleetEnv):
    from conftest import unique_model_name

    name = unique_model_name("evidx")
    writer = LmcDrivenWriter(env.servers[2], name, max_tokens=1024)
    try:
        ck = {"timeout": 20.0, "layout": writer.layout()}
        c = env.servers[2].chunk_size
        engine_seq = rand_tokens(2 * c, seed=8000)
        sdk_seq = rand_tokens(2 * c, seed=8001)
        nowhere = rand_tokens(2 * c, seed=8002)
        specs = env.specs()
        with KVEventsIndex(specs, name) as index, \
                Fleet(specs, name, connect_kwargs=ck) as fleet:
            writer.store(engine_seq)  # announced by the server as `stored` events
            with connect(env.servers[0].url, env.servers[0].http_url, name, layout=writer.layout(),
                         timeout=20.0) as ctx:  # an SDK store: the server announces nothing
                assert ctx.store(torch.randn(2, 2, 2 * c, 32).to(torch.bfloat16), sdk_seq)
            deadline = time.monotonic() + 10
            while index.prefix_chunks(engine_seq)[2] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert index.prefix_chunks(engine_seq) == [0, 0, 2]
            assert index.prefix_chunks(sdk_seq) == [0, 0, 0]
            rep = fleet.rewrite([engine_seq, sdk_seq, nowhere], drop_every_4th, route=index,
                                progress=False)
            assert (rep.ok, rep.missed) == (2, 1), rep.summary()
            assert rep.routes == {0: "srv2", 1: "srv0", 2: None}
            # the fleet's own stores are in the index now
            out_engine = whole(drop_every_4th(torch.zeros(1, 2 * c, 1), engine_seq)[1], c)
            assert index.prefix_chunks(out_engine)[2] == len(out_engine) // c
            env.servers[2].clear()  # removals are announced for every chunk
            deadline = time.monotonic() + 10
            while index.prefix_chunks(engine_seq)[2] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert index.prefix_chunks(engine_seq) == [0, 0, 0]
            assert index.prefix_chunks(out_engine) == [0, 0, 0]
    finally:
        writer.close()


# ---------------------------------------------------------------------- Ray Data
def test_ray_data_map_batches(env: FleetEnv):
    models = env.models("data")
    owned, kvs = _seed(models, per_server=2, chunks=2, base=9000)
    c = models[0].server.chunk_size
    seqs = [t for i in range(3) for t in owned[i]] + [rand_tokens(2 * c, seed=9999)]
    ds = ray.data.from_items([{"tokens": t, "id": k} for k, t in enumerate(seqs)])
    out = rewrite_dataset(ds, env.specs(), models[0].name, drop_every_4th, batch_size=4,
                          connect_kwargs=CONNECT, num_cpus=0)
    rows = sorted(out.take_all(), key=lambda r: r["id"])
    assert [r["kv_status"] for r in rows] == ["ok"] * 6 + ["missed"]
    assert [r["kv_server"] for r in rows] == ["srv0", "srv0", "srv1", "srv1", "srv2", "srv2", ""]
    assert rows[-1]["kv_stage"] == "route" and rows[0]["kv_tokens_moved"] > 0
    _check_outputs(models, owned, kvs)


def test_nothing_left_locked_on_any_server(env: FleetEnv):
    _all_unlocked(env)
