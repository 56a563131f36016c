"""The fleet over gRPC: ``Server("grpc://host:port", ...)`` on real ``--transport grpc``
servers (the suite's server version), one Ray node, a whole rewrite checked byte for byte."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator

import fleet_helpers
import pytest
import torch
from conftest import new_server, rand_tokens
from fleet_helpers import drop_every_4th, whole

pytest.importorskip("grpc", reason="gRPC needs the extra lmcache-kv-fast[grpc]")
ray = pytest.importorskip("ray", reason="the distributed tests need Ray")

import lmcache_kv_fast as lkf  # noqa: E402
from lmcache_kv_fast.distributed import Server, rewrite  # noqa: E402
from lmcache_kv_fast.layout import KVLayout  # noqa: E402
from lmcache_kv_fast.testing import LMCacheServer  # noqa: E402

pytestmark = pytest.mark.distributed
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def grpc_fleet() -> Iterator[list[LMCacheServer]]:
    servers = [new_server(shm=True, l1_size_gb=0.25, transport="grpc") for _ in range(2)]
    session_dir = None
    try:
        for s in servers:
            s.start()
        ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
        ray.cloudpickle.register_pickle_by_value(fleet_helpers)  # the edit, by value
        session_dir = ray._private.worker._global_node.get_session_dir_path()
        yield servers
    finally:
        ray.shutdown()
        for s in servers:
            s.stop()
        if session_dir:
            shutil.rmtree(session_dir, ignore_errors=True)


def test_grpc_urls_are_fleet_servers():
    s = Server("grpc://10.1.2.3:5555", "http://10.1.2.3:8080")
    assert s.host == "10.1.2.3" and s.name == s.url


def test_rewrite_across_grpc_servers(grpc_fleet):
    c = grpc_fleet[0].chunk_size
    model = "fleet-grpc"
    seqs = [rand_tokens(2 * c + 5, seed=700 + k) for k in range(6)]
    kvs = {}
    ctxs = [lkf.connect(s.url, s.http_url, model, timeout=20, layout=LAYOUT) for s in grpc_fleet]
    try:
        for k, t in enumerate(seqs):  # half the prefixes on each server
            kv = torch.randn(2, 2, len(t), 128).to(torch.bfloat16)
            assert ctxs[k % 2].store(kv, t)
            kvs[k] = kv
        specs = [Server(s.url, s.http_url) for s in grpc_fleet]
        rep = rewrite(specs, model, seqs, drop_every_4th, connect_kwargs={"layout": LAYOUT})
        assert rep.ok == len(seqs), [e.reason for e in rep.errors[:2]]
        for k, t in enumerate(seqs):
            edited, new = drop_every_4th(kvs[k][:, :, : 2 * c], t[: 2 * c])
            new = whole(new, c)
            got = ctxs[k % 2].retrieve(new)
            assert got is not None and torch.equal(got, edited[:, :, : len(new)])
    finally:
        for ctx in ctxs:
            ctx.close()
