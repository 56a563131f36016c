"""A real local Ray cluster (3 nodes) and three real LMCache servers, one per node.

Import the ``env`` fixture (``fleet_env_fixture``) into ONE test module (module scope: Ray and server
startup cost seconds); it always tears down the cluster's raylets/GCS and the servers
with their SHM segments. (Not a conftest.py: a second conftest module would clash with
tests/conftest.py under pytest's default import mode.)
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# No usage reporting from the local clusters (no network here; Ray Data's poller thread would
# print a connection traceback at exit).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")

ray = pytest.importorskip("ray", reason="the distributed tests need Ray (pip install 'lmcache-kv-fast[ray]')")

import fleet_helpers  # noqa: E402
from conftest import Model, make_model, new_server, wait_all_zero  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from lmcache_kv_fast.distributed import Server  # noqa: E402
from lmcache_kv_fast.testing import LMCacheServer  # noqa: E402

N_NODES = 3
#: Small lock lifetimes, so that what a killed actor held expires within the tests.
SERVER_ARGS = ["--l1-write-ttl-seconds", "6", "--l1-read-ttl-seconds", "6"]
WRITE_TTL = 6.0
OBJECT_STORE = 100 * 2**20


@dataclass
class FleetEnv:
    cluster: Cluster
    node_ids: list[str]
    servers: list[LMCacheServer]
    spare: LMCacheServer  # not in the fleet by default (a test may stop it)
    spare_node: Any  # a Ray node no server uses (a test may remove it)
    spare_node_id: str

    def specs(self, names: bool = True) -> list[Server]:
        return [Server(s.url, s.http_url, node=n, name=f"srv{i}" if names else "")
                for i, (s, n) in enumerate(zip(self.servers, self.node_ids))]

    def models(self, prefix: str) -> list[Model]:
        name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return [make_model(s, num_layers=2, num_kv_heads=2, head_size=64, name=name)
                for s in self.servers]


@pytest.fixture(scope="module", name="env")
def fleet_env_fixture() -> Iterator[FleetEnv]:
    servers = [new_server(shm=True, l1_size_gb=0.25, extra_args=SERVER_ARGS)
               for _ in range(N_NODES + 1)]
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
        spare_node = cluster.add_node(num_cpus=1, resources={"lmckv_node_spare": 1},
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
                if r.startswith("lmckv_node_") and r[-1].isdigit() and n["Alive"]:
                    by_res[int(r.rsplit("_", 1)[1])] = n["NodeID"]
        spare_id = next(n["NodeID"] for n in ray.nodes()
                        if n["Alive"] and "lmckv_node_spare" in n["Resources"])
        yield FleetEnv(cluster, [by_res[i] for i in range(N_NODES)], servers[:N_NODES],
                       servers[N_NODES], spare_node, spare_id)
    finally:
        for t in threads:
            t.join()
        session_dir = None
        try:
            session_dir = ray._private.worker._global_node.get_session_dir_path()
        except Exception:
            pass
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for s in servers:
            s.stop()
        if session_dir and os.path.basename(session_dir).startswith("session_") and \
                not os.environ.get("LMCACHE_KV_FAST_KEEP_RAY_LOGS"):
            shutil.rmtree(session_dir, ignore_errors=True)  # the cluster's logs


# ---------------------------------------------------------------------- commit trap
class CommitTrap:
    """A ZMQ proxy in front of one server that loses an actor at the worst moment.

    It forwards every request and reply unchanged until :meth:`arm` is called; then the
    first ``commit_store`` either never reaches the server (``mode="request"``: the
    store's slots stay prepared, as when an actor dies mid-copy) or reaches it but its
    reply is held back (``mode="reply"``: the store landed, the actor never knew), and
    ``on_trap()`` is called (the test kills the actor there).
    """

    COMMIT_OPS = (17, "commit_store")

    def __init__(self, backend_url: str, mode: str) -> None:
        import msgspec
        import zmq

        from lmcache_kv_fast.testing.server import free_port

        assert mode in ("request", "reply")
        self.mode, self.backend_url = mode, backend_url
        self.url = f"tcp://127.0.0.1:{free_port()}"
        self._zctx = zmq.Context()
        self._front = self._zctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.bind(self.url)
        self._dealers: dict[bytes, Any] = {}
        self._armed = threading.Event()
        self._stop = threading.Event()
        self.fired = threading.Event()
        self.on_trap: Callable[[], None] = lambda: None
        self._held_uid: bytes | None = None
        self._decode = msgspec.msgpack.decode
        self._thread = threading.Thread(target=self._loop, daemon=True, name="commit-trap")
        self._thread.start()

    def arm(self) -> None:
        self._armed.set()

    def _is_commit(self, op_frame: bytes) -> bool:
        try:
            return self._decode(op_frame) in self.COMMIT_OPS
        except Exception:
            return False

    def _fire(self) -> None:
        self._armed.clear()
        self.fired.set()
        self.on_trap()

    def _loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        owner: dict[Any, bytes] = {}
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self._front:
                    ident, *msg = self._front.recv_multipart()
                    if (self._armed.is_set() and not self.fired.is_set() and len(msg) >= 2
                            and self._is_commit(msg[1])):
                        if self.mode == "request":
                            self._fire()
                            continue
                        self._held_uid = msg[0]
                    d = self._dealers.get(ident)
                    if d is None:
                        d = self._dealers[ident] = self._zctx.socket(zmq.DEALER)
                        d.setsockopt(zmq.LINGER, 0)
                        d.connect(self.backend_url)
                        owner[d] = ident
                        poller.register(d, zmq.POLLIN)
                    d.send_multipart(msg)
                else:
                    msg = sock.recv_multipart()
                    if self._held_uid is not None and msg and msg[0] == self._held_uid:
                        self._held_uid = None
                        self._fire()
                        continue
                    try:
                        self._front.send_multipart([owner[sock], *msg])
                    except zmq.ZMQError:
                        pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for d in self._dealers.values():
            d.close(0)
        self._front.close(0)
        self._zctx.term()


def locks(server: LMCacheServer) -> dict[str, int]:
    """Locks and staged objects the server still holds."""
    l1 = server.status()["storage_manager"]["l1_manager"]
    return {k: int(l1.get(k, 0)) for k in
            ("read_locked_count", "write_locked_count", "staging_object_count")}


def wait_unlocked(server: LMCacheServer, timeout: float) -> dict[str, int]:
    """Poll :func:`locks` until all zero or ``timeout``; returns the last reading."""
    return wait_all_zero(lambda: locks(server), timeout, 0.2)
