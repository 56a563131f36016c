"""The gRPC control plane (``lmcache server --transport grpc``) against real servers.

0.5.6 from the main venv (SHM and pickle planes) and 0.5.7rc2 from its compat venv (SHM, and
its inline plane once this checkout has the TensorEnvelope, dataplane/envelope.py): connect, store /
retrieve bit-exact, lookup, store_ex, threads, error replies, a wrong-transport URL, a
server killed mid-call, and interop with upstream's own SDK over gRPC.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import rand_tokens, run_threads, unique_model_name

import lmcache_kv_fast as lkf
import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast.errors import ConnectionLostError, ServerError
from lmcache_kv_fast.layout import KVLayout
from lmcache_kv_fast.protocol.keys import make_key
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.testing import LMCacheServer
from testbed.compat import TheirSDK, compat_server, venv_python

pytest.importorskip("grpc")

C = 256
V057 = "0.5.7rc2"
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)


def _start(srv: LMCacheServer) -> Iterator[LMCacheServer]:
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def _has_grpc(python: str) -> bool:
    return subprocess.run([python, "-c", "import grpc"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def grpc56_shm() -> Iterator[LMCacheServer]:
    """A real 0.5.6 server, gRPC transport, SHM plane."""
    yield from _start(LMCacheServer(shm=True, l1_size_gb=0.5, transport="grpc"))


@pytest.fixture(scope="module")
def grpc56_pickle() -> Iterator[LMCacheServer]:
    """A real 0.5.6 server, gRPC transport, pickle plane."""
    yield from _start(LMCacheServer(shm=False, l1_size_gb=0.5, transport="grpc"))


@pytest.fixture(scope="module")
def grpc57_shm() -> Iterator[LMCacheServer]:
    """A real 0.5.7rc2 server (compat venv with grpcio), gRPC transport, SHM plane."""
    py = venv_python(V057)
    if py is None or not _has_grpc(py):
        pytest.skip(f"no {V057} venv with grpcio (scripts/compat-venvs.sh {V057})")
    yield from _start(compat_server(V057, shm=True, l1_size_gb=0.5, transport="grpc"))


@pytest.fixture(scope="module")
def grpc57_inline() -> Iterator[LMCacheServer]:
    """A real 0.5.7rc2 server, gRPC transport, inline (TensorEnvelope) plane."""
    if importlib.util.find_spec("lmcache_kv_fast.dataplane.envelope") is None:
        pytest.skip("the 0.5.7 inline plane (TensorEnvelope) is not in this checkout")
    py = venv_python(V057)
    if py is None or not _has_grpc(py):
        pytest.skip(f"no {V057} venv with grpcio (scripts/compat-venvs.sh {V057})")
    yield from _start(compat_server(V057, shm=False, l1_size_gb=0.5, transport="grpc"))


@pytest.fixture(params=["grpc57_shm", "grpc56_shm", "grpc56_pickle", "grpc57_inline"])
def gserver(request: pytest.FixtureRequest) -> LMCacheServer:
    """Each test runs against every gRPC server."""
    return request.getfixturevalue(request.param)


def _connect(srv: LMCacheServer, name: str | None = None, timeout: float = 20.0,
             **kw) -> lkf.LMCacheKVCacheContext:
    return lmc_sdk.connect(srv.url, srv.http_url, name or unique_model_name("g"),
                           layout=LAYOUT, timeout=timeout, **kw)


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.tensor_shape(tokens), generator=g).to(torch.bfloat16)


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


def test_roundtrip_lookup_store_ex(gserver):
    ctx = _connect(gserver)
    try:
        assert ctx.transport == ("shm" if gserver.shm else "pickle")
        toks = rand_tokens(3 * C + 40, seed=1)
        kv = _kv(len(toks), seed=2)
        assert ctx.lookup(toks) == 0
        res = ctx.store_ex(kv, toks)
        assert (res.chunks_total, res.chunks_written, res.chunks_refused) == (3, 3, 0)
        assert res.tokens_stored == 3 * C
        assert ctx.lookup(toks) == 3 * C
        assert _same(ctx.retrieve(toks), kv[:, :, : 3 * C])
        again = ctx.store_ex(kv, toks)
        assert again.chunks_already_cached == 3 and again.chunks_written == 0 and again.ok
        out = torch.empty(LAYOUT.tensor_shape(4 * C), dtype=torch.bfloat16)
        got = ctx.retrieve(toks[: 2 * C], out=out)
        assert got is not None and got.data_ptr() == out.data_ptr()
        assert _same(got, kv[:, :, : 2 * C])
        assert ctx.retrieve(rand_tokens(C, seed=3)) is None
        # salts keep tenants apart
        assert ctx.store(kv[:, :, :C], toks[:C], cache_salt="t1")
        assert ctx.lookup(toks[:C], cache_salt="t2") == 0
        assert _same(ctx.retrieve(toks[:C], cache_salt="t1"), kv[:, :, :C])
        assert ctx.ping()
    finally:
        ctx.close()
    assert ctx.closed
    _assert_nothing_held(gserver)


def _assert_nothing_held(srv: LMCacheServer, timeout: float = 3.0) -> None:
    """No session, prefetch job or read lock is left on the server (nothing leaked)."""
    st = srv.settled_status(timeout)
    l1 = st.get("storage_manager", {}).get("l1_manager", {})
    assert st.get("active_sessions") == 0, st.get("active_sessions")
    assert st.get("active_prefetch_jobs") == 0
    assert l1.get("read_locked_count", 0) == 0


def test_tensor_parallel_shards(grpc57_shm):
    """world_size 2: one key per rank (worker_id) in every keyed RPC."""
    ctx = _connect(grpc57_shm, world_size=2)
    try:
        toks = rand_tokens(2 * C, seed=41)
        kv = _kv(2 * C, seed=42)
        assert ctx.store(kv, toks)
        assert ctx.lookup(toks) == 2 * C
        assert _same(ctx.retrieve(toks), kv)
    finally:
        ctx.close()
    _assert_nothing_held(grpc57_shm)


def test_threads_share_a_context(gserver):
    ctx = _connect(gserver)
    try:
        def work(i: int) -> None:
            for j in range(3):
                toks = rand_tokens(2 * C, seed=100 * i + j)
                kv = _kv(2 * C, seed=100 * i + j)
                assert ctx.store(kv, toks)
                assert _same(ctx.retrieve(toks), kv)
                assert ctx.lookup(toks) == 2 * C

        assert run_threads(work, 4) == []
    finally:
        ctx.close()
    _assert_nothing_held(gserver)


def test_server_error_reply_is_a_server_error(grpc57_shm):
    """Over gRPC a request the server's handler raises on comes back as an error at once."""
    from lmcache_kv_fast.transport.grpc_client import GrpcClient

    srv = grpc57_shm
    client = GrpcClient(srv.url, srv.generation, 10.0)
    try:
        key = make_key(srv.generation, model_name="nope", world_size=1, worker_id=None,
                       tokens=[1] * C, start=0, end=C, request_id="bad")
        key.token_bytes = b"abc"  # not a whole number of uint32 tokens: the handler raises
        t0 = time.monotonic()
        with pytest.raises(ServerError) as ei:
            client.call(Op.LOOKUP, [key, 1])
        assert time.monotonic() - t0 < 5
        assert ei.value.code == "UNKNOWN"
        assert "lookup failed on the server" in str(ei.value)
        assert "whole number" in str(ei.value)  # the server's own message
        assert isinstance(ei.value, lkf.ProtocolError)
        assert client.call(Op.NOOP) == "OK"  # the client is still usable
    finally:
        client.close()


def test_zmq_url_to_grpc_server_names_both(grpc56_shm):
    srv = grpc56_shm
    t0 = time.monotonic()
    with pytest.raises(lkf.KVCacheSDKError) as ei:
        lmc_sdk.connect(f"tcp://127.0.0.1:{srv.port}", srv.http_url, "m", layout=LAYOUT,
                        timeout=60)
    assert time.monotonic() - t0 < 5.5
    msg = str(ei.value)
    assert "'grpc'" in msg and "zmq URL" in msg and "grpc://host:port" in msg


def test_grpc_url_to_zmq_server_names_both(server_shm):
    t0 = time.monotonic()
    with pytest.raises(lkf.KVCacheSDKError) as ei:
        lmc_sdk.connect(f"grpc://127.0.0.1:{server_shm.port}", server_shm.http_url, "m",
                        layout=LAYOUT, timeout=60)
    assert time.monotonic() - t0 < 5.5
    msg = str(ei.value)
    assert "'zmq'" in msg and "grpc URL" in msg and "tcp://host:port" in msg


def test_missing_grpcio_is_a_missing_extra_error():
    script = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith("grpc."):
            raise ImportError("No module named 'grpc' (blocked)")
sys.meta_path.insert(0, Block())
import lmcache_kv_fast as lkf
from lmcache_kv_fast.errors import MissingExtraError
try:
    lkf.connect("grpc://127.0.0.1:1", "http://127.0.0.1:1", "m", timeout=5)
except MissingExtraError as e:
    assert isinstance(e, ImportError) and isinstance(e, lkf.KVCacheSDKError)
    print("MISSING", e)
ctx_ok = True
try:
    lkf.connect("tcp://127.0.0.1:1", "http://127.0.0.1:1", "m", timeout=1)
except MissingExtraError:
    ctx_ok = False
except lkf.KVCacheSDKError:
    pass
print("ZMQ_UNAFFECTED", ctx_ok, "grpc" in sys.modules)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MISSING" in out.stdout and "pip install 'lmcache-kv-fast[grpc]'" in out.stdout
    assert "ZMQ_UNAFFECTED True False" in out.stdout


def test_killed_server_mid_call_fails_clearly():
    """SIGKILL while calls are in flight: each fails within a bound, never hangs."""
    srv = LMCacheServer(shm=True, l1_size_gb=0.5, transport="grpc").start()
    try:
        ctx = _connect(srv, timeout=8.0)
        toks = rand_tokens(8 * C, seed=7)
        kv = _kv(8 * C, seed=8)
        assert ctx.store(kv, toks)
        errors: list[BaseException] = []
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                try:
                    ctx.retrieve(toks)
                    ctx.lookup(toks)
                except lkf.KVCacheSDKError as err:
                    errors.append(err)
                    return

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.kill()
        th.join(20)
        stop.set()
        assert not th.is_alive(), "a call hung after the server was killed"
        assert errors, "no call failed"
        assert time.monotonic() - t0 < 10
        assert isinstance(errors[0], lkf.ServerTimeoutError)
        # later calls fail too, within the timeout, and say why
        t1 = time.monotonic()
        with pytest.raises(lkf.KVCacheSDKError) as ei:
            ctx.lookup(toks)
        assert time.monotonic() - t1 < 10
        assert "reply" in str(ei.value) or "connection" in str(ei.value)
        t2 = time.monotonic()
        ctx.close()
        assert time.monotonic() - t2 < 8  # obligations dropped; one unregister probe
    finally:
        srv.stop()


def test_restarted_server_says_reconnect():
    srv = LMCacheServer(shm=True, l1_size_gb=0.5, transport="grpc").start()
    try:
        ctx = _connect(srv, timeout=8.0)
        toks = rand_tokens(C, seed=9)
        assert ctx.store(_kv(C, seed=10), toks)
        srv.restart()
        with pytest.raises(lkf.KVCacheSDKError, match="reconnect"):
            for _ in range(3):  # the first call may be the one that notices the drop
                ctx.retrieve(toks)
        ctx.close()
    finally:
        srv.stop()


@pytest.mark.parametrize(("version", "fixture"), [
    (V057, "grpc57_shm"), ("0.5.6", "grpc56_shm"), ("0.5.6", "grpc56_pickle"),
    (V057, "grpc57_inline")])
def test_upstream_sdk_over_grpc_interop(version, fixture, request, tmp_path):
    """Upstream's own SDK stores over gRPC, ours retrieves bit-exact, and the reverse."""
    srv = request.getfixturevalue(fixture)
    name = unique_model_name("gi")
    with TheirSDK(version, srv.url, srv.http_url, tmp_path) as theirs:
        theirs.register_hnd(name, num_layers=2, num_kv_heads=4, head_size=64)
        h = theirs.connect(name)
        ours = lmc_sdk.connect(srv.url, srv.http_url, name, timeout=30)
        try:
            toks = rand_tokens(2 * C, seed=11)
            kv = torch.randn(2, 2, 2 * C, 256).to(torch.bfloat16)
            assert theirs.store(h, kv, toks)
            assert _same(ours.retrieve(toks), kv)
            import lmcache_kv_fast.sdk as lsdk  # the 0.5.6 sdk package takes grpc:// too

            with lsdk.connect(lsdk.LMCacheSDKCacheKind.KV, srv.url, srv.http_url, name,
                              timeout=30) as sctx:
                assert _same(sctx.retrieve(toks), kv)
            toks_b = rand_tokens(3 * C, seed=12)
            kv_b = torch.randn(2, 2, 3 * C, 256).to(torch.bfloat16)
            assert ours.store(kv_b, toks_b)
            got = theirs.retrieve(h, toks_b)
            assert got is not None and _same(got.reshape(kv_b.shape), kv_b)
        finally:
            ours.close()
            theirs.close(h)


def test_signal_stopped_server_times_out(grpc56_pickle):
    """A frozen server (SIGSTOP) is a timeout, as over ZMQ; it answers again after SIGCONT."""
    srv = grpc56_pickle
    ctx = _connect(srv, timeout=2.0)
    toks = rand_tokens(C, seed=13)
    try:
        assert ctx.store(_kv(C, seed=14), toks)
        assert srv.proc is not None
        os.killpg(srv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(lkf.ServerTimeoutError):
                ctx.lookup(toks)
            assert time.monotonic() - t0 < 6
        finally:
            os.killpg(srv.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert ctx.lookup(toks) == C
                break
            except lkf.ServerTimeoutError:
                if time.monotonic() > deadline:
                    raise
        # the timed-out lookup ran late: its obligation freed its locks and ended it
        _assert_nothing_held(srv, timeout=10.0)
    finally:
        ctx.close()


def test_connection_lost_error_is_both_kinds():
    assert issubclass(ConnectionLostError, lkf.ServerTimeoutError)
    assert issubclass(ConnectionLostError, lkf.ServerUnavailableError)


# ---------------------------------------------------------------------- KV events over gRPC
@pytest.fixture(params=["grpc57_shm", "grpc56_shm"])
def eserver(request: pytest.FixtureRequest) -> LMCacheServer:
    """The gRPC servers with a KV-event stream (both planes record the same events)."""
    return request.getfixturevalue(request.param)


def _next_with_events(sub, tries: int = 20):
    for _ in range(tries):
        b = next(sub)
        if b.events:
            return b
    raise AssertionError("no batch with events")


def test_events_over_grpc_removed_after_clear(eserver):
    pytest.importorskip("blake3")
    from lmcache_kv_fast import events
    from lmcache_kv_fast.events.stream_grpc import GrpcKVEventSubscription
    from lmcache_kv_fast.hashing import chunk_hashes

    with _connect(eserver) as ctx, events.subscribe(ctx, timeout=10.0) as sub:
        assert isinstance(sub, GrpcKVEventSubscription)
        first = next(sub)
        assert first.enabled and sub.active and sub.cursor == first.next_cursor
        toks = rand_tokens(2 * C + 17, seed=21)
        assert ctx.store(_kv(len(toks), seed=22), toks)
        assert sub.poll(0.5) is None  # SDK (engine-driven) stores record no `stored` event
        eserver.clear()
        rm = _next_with_events(sub)
        assert [r.kind for r in rm.events] == ["removed"]
        assert set(rm.events[0].block_hashes) == set(chunk_hashes(toks, C))
    assert sub.closed and sub.end_reason == "closed by the client"
    deadline = time.monotonic() + 3
    while (left := [t.name for t in threading.enumerate()
                    if t.name.startswith("lmcache-kv-fast-events-")]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"leaked threads: {left}"


def test_events_over_grpc_endpoint_lost_and_replaced(eserver):
    from lmcache_kv_fast import events

    ep = events.EventsEndpoint.probe(eserver.url, eserver.http_url, unique_model_name("ge"))
    with events.subscribe(ep, cursor=10**12) as sub:
        b = next(sub)
        assert b.lost and b.resync and not b.incarnation_changed and b.next_cursor < 10**12
    first = events.subscribe(ep, timeout=10.0)
    second = events.subscribe(ep, instance_id=first.instance_id)
    try:
        with pytest.raises(StopIteration):
            while True:
                next(first)
        assert "newer subscription" in (first.end_reason or "")
        assert first.closed and second.active
    finally:
        second.close()
        first.close()


def test_events_over_grpc_close_with_context(grpc56_shm):
    from lmcache_kv_fast import events

    ctx = _connect(grpc56_shm)
    sub = events.subscribe(ctx)
    next(sub)
    ctx.close()
    deadline = time.monotonic() + 5
    while not sub.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sub.closed and "context" in (sub.end_reason or "")
    with pytest.raises(StopIteration):
        next(sub)


def test_events_over_grpc_survive_a_restart():
    from lmcache_kv_fast import events

    srv = LMCacheServer(shm=True, l1_size_gb=0.5, transport="grpc").start()
    try:
        ep = events.EventsEndpoint.probe(srv.url, srv.http_url, unique_model_name("gr"))
        with events.subscribe(ep, timeout=30.0) as sub:
            b0 = next(sub)
            srv.restart()
            b1 = next(sub)
            assert b1.incarnation_changed and b1.resync
            assert b1.incarnation != b0.incarnation and sub.active
    finally:
        srv.stop()


def test_store_timed_out_is_finished_late(grpc56_shm):
    """A store whose prepare_store timed out (server frozen) is finished by its late reply:
    the reservation is filled from the snapshot and committed, over gRPC as over ZMQ."""
    srv = grpc56_shm
    ctx = _connect(srv, timeout=1.5)
    toks = rand_tokens(2 * C, seed=51)
    kv = _kv(2 * C, seed=52)
    assert srv.proc is not None
    try:
        os.killpg(srv.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(lkf.ServerTimeoutError):
                ctx.store(kv, toks)
        finally:
            os.killpg(srv.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while ctx.lookup(toks) < 2 * C:
            assert time.monotonic() < deadline, "the late store never landed"
            time.sleep(0.1)
        assert _same(ctx.retrieve(toks), kv)
        _assert_nothing_held(srv, timeout=10.0)
    finally:
        ctx.close()


def test_batch_over_grpc(grpc57_shm):
    """The batch layer runs on the same channels: store_many, retrieve_many, rewrite."""
    from lmcache_kv_fast import batch

    ctx = _connect(grpc57_shm)
    try:
        items = [(_kv(2 * C, seed=60 + i), rand_tokens(2 * C, seed=70 + i)) for i in range(6)]
        rep = batch.store_many(ctx, items, max_in_flight=3)
        assert rep.ok == 6 and rep.failed == 0
        got = dict(batch.retrieve_many(ctx, [t for _, t in items], max_in_flight=3))
        assert all(_same(got[i], kv) for i, (kv, _) in enumerate(items))
        rep = batch.rewrite(ctx, [t for _, t in items[:2]],
                            lambda kv, toks: (kv.neg(), [t + 1 for t in toks]), progress=False)
        assert rep.ok == 2
        moved = [t + 1 for t in items[0][1]]
        assert _same(ctx.retrieve(moved), items[0][0].neg())
    finally:
        ctx.close()
    _assert_nothing_held(grpc57_shm)


class _UnixToTcp:
    """Forward a Unix socket to the server's TCP port, byte for byte (the server binds TCP
    only; a ``grpc+unix://`` URL reaches it through a forwarder like this one)."""

    def __init__(self, port: int, path: str) -> None:
        import socket

        self.port, self.path = port, path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                front, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            back = socket.create_connection(("127.0.0.1", self.port))
            for a, b in ((front, back), (back, front)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        os.unlink(self.path)


def test_grpc_unix_url_through_a_forwarder(grpc57_shm, tmp_path):
    fwd = _UnixToTcp(grpc57_shm.port, str(tmp_path / "mp.sock"))
    try:
        url = f"grpc+unix://{fwd.path}"
        ctx = lmc_sdk.connect(url, grpc57_shm.http_url, unique_model_name("gu"),
                              layout=LAYOUT, timeout=20)
        try:
            toks = rand_tokens(C, seed=81)
            kv = _kv(C, seed=82)
            assert ctx.store(kv, toks)
            assert _same(ctx.retrieve(toks), kv)
        finally:
            ctx.close()
        assert fwd.connections >= 1  # the calls really went through the Unix socket
    finally:
        fwd.close()
