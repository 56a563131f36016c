"""A real local Ray cluster (3 nodes) and three real LMCache servers, one per node.

Import the ``fleet_env`` fixture into ONE test module (module scope: Ray and server
startup cost seconds); it always tears down the cluster's raylets/GCS and the servers
with their SHM segments. (Not a conftest.py: a second conftest module would clash with
tests/conftest.py under pytest's default import mode.)
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ray = pytest.importorskip("ray", reason="the distributed tests need Ray (pip install 'lmcache-kv-fast[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402

import fleet_helpers  # noqa: E402
from conftest import Model, make_model  # noqa: E402
from lmcache_kv_fast.distributed import Server  # noqa: E402
from lmcache_kv_fast.testing import LMCacheServer  # noqa: E402

N_NODES = 3
#: Small lock lifetimes, so that what a killed actor held expires within the tests.
SERVER_ARGS = ["--l1-write-ttl-seconds", "4", "--l1-read-ttl-seconds", "8"]
OBJECT_STORE = 100 * 2**20


@dataclass
class FleetEnv:
    cluster: Cluster
    node_ids: list[str]
    servers: list[LMCacheServer]

    def specs(self, names: bool = True) -> list[Server]:
        return [Server(s.url, s.http_url, node=n, name=f"srv{i}" if names else "")
                for i, (s, n) in enumerate(zip(self.servers, self.node_ids))]

    def models(self, prefix: str) -> list[Model]:
        name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return [make_model(s, num_layers=2, num_kv_heads=2, head_size=64, name=name)
                for s in self.servers]


@pytest.fixture(scope="module")
def fleet_env() -> Iterator[FleetEnv]:
    servers = [LMCacheServer(shm=True, l1_size_gb=0.25, extra_args=SERVER_ARGS)
               for _ in range(N_NODES)]
    errors: list[BaseException] = []

    def start(s: LMCacheServer) -> None:
        try:
            s.start()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    cluster = None
    try:
        for t in threads:
            t.start()
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"lmckv_node_0": 1}, "object_store_memory": OBJECT_STORE,
            "include_dashboard": False})
        for i in range(1, N_NODES):
            cluster.add_node(num_cpus=1, resources={f"lmckv_node_{i}": 1},
                             object_store_memory=OBJECT_STORE)
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        ray.cloudpickle.register_pickle_by_value(fleet_helpers)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        by_res = {}
        for n in ray.nodes():
            for r in n["Resources"]:
                if r.startswith("lmckv_node_") and n["Alive"]:
                    by_res[int(r.rsplit("_", 1)[1])] = n["NodeID"]
        yield FleetEnv(cluster, [by_res[i] for i in range(N_NODES)], servers)
    finally:
        for t in threads:
            t.join()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for s in servers:
            s.stop()
