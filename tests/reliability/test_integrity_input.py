"""Integrity under faults (issue 19, items 7, 8, 9, 14): arguments, URLs, slow peers, fork.

* ``copy_threads`` beyond the core's maximum and bad ``BufferPool`` arguments are SDK
  errors naming the argument, raised before anything is created.
* A URL ZMQ would refuse (trailing newline, wildcard or non-ASCII host) fails at once; a
  construction that fails half-way closes every socket it opened (the ZMQ context
  terminates, no fd or thread is left).
* An HTTP peer that drip-feeds its reply cannot hold a call past its deadline.
* A context used in a child after ``fork()`` raises at once; the child can connect its own,
  and the parent's context keeps working.

Every test that could hang before its fix has a pytest timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import make_model, rand_tokens
from fake_peer import Snapshot

import lmcache_kv_fast as lkf
from lmcache_kv_fast import batch
from lmcache_kv_fast.protocol.ops import GEN_056, Op
from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.urls import Endpoint
from lmcache_kv_fast.transport.zmq_client import ZmqClient

C = 256


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _ours(names: set[str]) -> set[str]:
    """Threads of this SDK (not pytest's, not a fake peer's request handlers)."""
    return {n for n in names if "process_request" not in n and "drip" not in n}


# ----------------------------------------------------------------------------- item 7
@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [0, 1025, 100_000, -1, True, 2.0, "4"])
def test_copy_threads_out_of_range_is_refused_before_anything(server_shm: LMCacheServer,
                                                              threads: Any) -> None:
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=64)
    before = Snapshot.take()
    with pytest.raises(lkf.InvalidArgumentError) as ei:
        lkf.connect(server_shm.url, server_shm.http_url, m.name, timeout=10,
                    copy_threads=threads)
    msg = str(ei.value)
    assert msg.startswith("copy_threads must be an int in [1, 1024]"), msg
    after = Snapshot.take()
    assert after.threads == before.threads
    assert after.fds <= before.fds


@pytest.mark.timeout(60)
def test_buffer_pool_arguments_are_named(server_shm: LMCacheServer) -> None:
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=64)
    with lkf.connect(server_shm.url, server_shm.http_url, m.name, timeout=10) as ctx:
        cases: list[tuple[tuple[Any, ...], type[Exception], str]] = [
            ((ctx, ("4", 2), 2), lkf.InvalidTypeError, "max_tokens"),
            ((ctx, "4", 2), lkf.InvalidTypeError, "max_tokens"),
            ((ctx, 4.0, 2), lkf.InvalidTypeError, "max_tokens"),
            ((ctx, True, 2), lkf.InvalidTypeError, "max_tokens"),
            ((ctx, 0, 2), lkf.InvalidArgumentError, "max_tokens"),
            ((ctx, 4, "2"), lkf.InvalidTypeError, "size"),
            ((ctx, 4, None), lkf.InvalidTypeError, "size"),
            ((ctx, 4, -1), lkf.InvalidArgumentError, "size"),
            (("ctx", 4, 2), lkf.InvalidTypeError, "ctx"),
        ]
        for args, exc, name in cases:
            with pytest.raises(exc) as ei:
                batch.BufferPool(*args)
            assert f"BufferPool: {name} must be" in str(ei.value), (args, str(ei.value))
        pool = batch.BufferPool(ctx, C, 2)  # still fine
        assert pool.size == 2 and pool.shape == ctx.kv_shape(C)


# ----------------------------------------------------------------------------- item 9
BAD_URLS = [
    # (url suffix / replacement, http_url change, what the message says)
    ("zmq_trailing_newline", lambda s: (s.url + "\n", s.http_url), "ends with a newline"),
    ("zmq_trailing_crlf", lambda s: (s.url + "\r\n", s.http_url), "ends with a newline"),
    ("zmq_inner_space", lambda s: (s.url.replace("//", "// "), s.http_url), "whitespace"),
    ("zmq_wildcard", lambda s: (f"tcp://*:{s.port}", s.http_url), "wildcard"),
    ("zmq_non_ascii", lambda s: (f"tcp://hôst:{s.port}", s.http_url), "ASCII"),
    ("zmq_non_ascii_port", lambda s: ("tcp://127.0.0.1:٥٥٥٥", s.http_url), "ASCII"),
    ("zmq_unbracketed_v6", lambda s: (f"tcp://::1:{s.port}", s.http_url), "brackets"),
    ("zmq_bad_v6", lambda s: (f"tcp://[::g]:{s.port}", s.http_url), "IPv6"),
    ("zmq_bad_ipv4", lambda s: (f"tcp://127.0.0.300:{s.port}", s.http_url), "IPv4"),
    ("zmq_tab", lambda s: (s.url.replace("tcp", "tcp\t"), s.http_url), "whitespace"),
    ("zmq_nul", lambda s: (s.url + "\x00", s.http_url), "control"),
    ("http_trailing_newline", lambda s: (s.url, s.http_url + "\n"), "ends with a newline"),
    ("http_wildcard", lambda s: (s.url, f"http://*:{s.http_port}"), "wildcard"),
    ("http_non_ascii", lambda s: (s.url, f"http://hôst:{s.http_port}"), "ASCII"),
    ("http_query", lambda s: (s.url, s.http_url + "?x=1"), "no path"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", [c[0] for c in BAD_URLS])
def test_connect_refuses_bad_url_at_once(server_shm: LMCacheServer, case: str) -> None:
    """Before: the URL check let these through and connect() hung in zmq_ctx_term()."""
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=64)
    _, make, why = next(c for c in BAD_URLS if c[0] == case)
    url, http_url = make(server_shm)
    before = Snapshot.take()
    with pytest.raises(lkf.InvalidArgumentError) as ei:
        lkf.connect(url, http_url, m.name, timeout=5)
    msg = str(ei.value)
    assert msg.startswith(("url must look like", "http_url must look like")), msg
    assert why in msg, msg
    assert repr(url if msg.startswith("url") else http_url)[:40] in msg  # shows what came
    after = Snapshot.take()
    assert after.threads == before.threads
    assert after.fds <= before.fds


def _terminates(client: ZmqClient, seconds: float = 10.0) -> bool:
    """Whether ``client.close()`` (and its zmq_ctx_term) returns in time."""
    t = threading.Thread(target=client.close, name="lmckvf-test-close", daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


@pytest.mark.timeout(60)
def test_failed_channel_construction_closes_what_it_opened() -> None:
    """A socket ZMQ refuses to connect: DEALER and monitor are closed, term() returns."""
    fds, threads = _fds(), _ours(Snapshot.take().threads)
    for _ in range(3):
        client = ZmqClient("tcp://127.0.0.1:9", GEN_056, 1.0)
        # An address only ZMQ refuses (the URL parser stops these before a client exists).
        client.endpoint = Endpoint("tcp", "*", 5555)
        with pytest.raises(lkf.InvalidArgumentError, match="ZMQ cannot connect"):
            client.channel()
        with pytest.raises(lkf.InvalidArgumentError, match="ZMQ cannot connect"):
            client.new_channel()
        assert _terminates(client), "zmq_ctx_term() blocked on a socket left open"
    assert _fds() <= fds
    assert _ours(Snapshot.take().threads) <= threads


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url", ["tcp://*:5555", "tcp://127.0.0.1:5555\n", "tcp://hôst:1"])
def test_zmq_client_refuses_bad_url_before_creating_anything(url: str) -> None:
    fds = _fds()
    with pytest.raises(lkf.InvalidArgumentError, match="url must look like"):
        ZmqClient(url, GEN_056, 1.0)
    assert _fds() <= fds


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_bracketed_ipv6_url_reaches_the_peer() -> None:
    """``tcp://[::1]:port`` is accepted and reaches a peer (the socket gets ZMQ_IPV6)."""
    import zmq

    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.IPV6, 1)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://[::1]")
    client = ZmqClient(f"tcp://[::1]:{port}", GEN_056, 5.0)
    try:
        call = client.channel().send(Op.NOOP)
        assert router.poll(5000), "the request never reached the IPv6 peer"
        ident, uid, op = router.recv_multipart()
        router.send_multipart([ident, uid, op, b"\xa2OK"])
        assert client.channel().wait(call) == "OK"
    finally:
        assert _terminates(client)
        router.close(0)
        zctx.term()


@pytest.mark.timeout(60)
def test_a_send_with_nowhere_to_go_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DEALER with no connection to queue on blocks its sends (ZMQ drops a connection
    whose peer fails the handshake for good; ``ZMQ_IMMEDIATE`` stands in for that state
    here). The SDK's sends raise after their timeout instead; the channel forgets the
    call. Seen once in CI: ``zmq_noop`` against a gRPC server's port blocked 300 s."""
    import zmq

    from lmcache_kv_fast.transport import zmq_client
    from lmcache_kv_fast.transport.zmq_socket import Dealer

    zctx = zmq.Context()
    dealer = Dealer(zctx, "tcp://127.0.0.1:9", options=[(zmq.IMMEDIATE, 1)], events=0,
                    send_timeout=0.3)
    try:
        t = time.monotonic()
        with pytest.raises(lkf.ServerUnavailableError,
                           match=r"noop could not be sent to tcp://127.0.0.1:9 within 0.3s"):
            dealer.send([b"uid", b"op"], "noop")
        assert 0.25 < time.monotonic() - t < 5
    finally:
        dealer.close()
        zctx.term()
    monkeypatch.setattr(zmq_client, "CHANNEL_OPTIONS",
                        (*zmq_client.CHANNEL_OPTIONS, (zmq.IMMEDIATE, 1)))
    client = ZmqClient("tcp://127.0.0.1:9", GEN_056, 0.3)
    try:
        ch = client.channel()
        with pytest.raises(lkf.ServerUnavailableError, match="not an LMCache ZMQ server"):
            ch.send(Op.NOOP)
        assert not ch._inflight
    finally:
        assert _terminates(client)


# ----------------------------------------------------------------------------- item 8
class DripServer:
    """An HTTP peer that sends its reply one byte every ``interval`` seconds."""

    def __init__(self, reply: bytes, interval: float = 0.2) -> None:
        self.reply = reply
        self.interval = interval
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.served = 0
        self.t = threading.Thread(target=self._accept, name="drip-accept", daemon=True)
        self.t.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._drip, args=(conn,), name="drip-conn", daemon=True)
            self.threads.append(t)
            t.start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.5)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the request
                for i in range(len(self.reply)):
                    if self.stop.wait(self.interval):
                        return
                    conn.sendall(self.reply[i:i + 1])
                    self.served += 1

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.t.join(5)
        for t in self.threads:
            t.join(5)


@contextlib.contextmanager
def _drip(reply: bytes) -> Iterator[DripServer]:
    d = DripServer(reply)
    try:
        yield d
    finally:
        d.close()


_BODY = b'{"mp": {"chunk_size": 256, "padding": "' + b"x" * 2000 + b'"}}'
DRIP_REPLIES = {
    "body": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY,
    "headers": b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"y" * 2000 + b"\r\n\r\n{}",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("part", sorted(DRIP_REPLIES))
def test_drip_fed_config_cannot_hold_connect(part: str) -> None:
    """Before: every byte came within the per-read timeout and connect() waited ~400 s."""
    with _drip(DRIP_REPLIES[part]) as d:
        t0 = time.monotonic()
        with pytest.raises(lkf.ServerTimeoutError) as ei:
            lkf.connect("tcp://127.0.0.1:9", d.url, "m", timeout=1.0)
        took = time.monotonic() - t0
        assert "did not answer within 1s" in str(ei.value), str(ei.value)
        assert d.served >= 1  # it was dripping, not silent
        assert took < 10, f"connect took {took:.1f}s"  # the deadline is 1 s; slack for load


@pytest.mark.timeout(60)
def test_http_calls_have_a_total_deadline() -> None:
    """The connect probe's cap (5 s) bounds a call whatever the caller's timeout."""
    with _drip(DRIP_REPLIES["body"]) as d:
        http = HttpInfoClient(d.url, 0.6)
        t0 = time.monotonic()
        with pytest.raises(lkf.ServerTimeoutError, match="within 0.6s"):
            http.config()
        assert time.monotonic() - t0 < 10
        with pytest.raises(lkf.ServerTimeoutError, match="within 0.4s"):
            http.get("/status", timeout=0.4)


# ----------------------------------------------------------------------------- item 14
def _wait_child(pid: int, seconds: float) -> int:
    """The child's exit code; it is killed (and the test fails) when it outlives ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the child {pid} was still running after {seconds}s (it hung)")


def _registered(srv: LMCacheServer) -> set[str]:
    return set((srv.http().status().get("non_cuda_context_meta") or {}).keys())


# Exit codes of the child: 0 = all checks passed; anything else says which failed.
_CHILD_CHECKS = ("lookup", "retrieve", "store", "ping", "clear", "batch", "pool", "events",
                 "close", "del", "own_connect", "own_roundtrip")


def _child(ctx: lkf.LMCacheKVCacheContext, srv: LMCacheServer, model: str,
           toks: list[int], kv: Any) -> int:
    """Runs in the forked child; returns its exit code (never raises)."""
    from lmcache_kv_fast.events import subscribe

    def refused(code: int, call: Any) -> int:
        t0 = time.monotonic()
        try:
            call()
        except lkf.KVCacheSDKError as err:
            if "fork()" not in str(err) or f"process {os.getpid()}" not in str(err):
                return code
            if time.monotonic() - t0 > 2.0:
                return code
            return 0
        except BaseException:
            return code
        return code

    checks = [
        lambda: ctx.lookup(toks),
        lambda: ctx.retrieve(toks),
        lambda: ctx.store(kv, toks),
        ctx.ping,
        ctx.clear,
        lambda: next(batch.retrieve_many(ctx, [toks])),
        lambda: batch.BufferPool(ctx, C, 1),
        lambda: subscribe(ctx),
    ]
    for code, call in enumerate(checks, start=10):
        rc = refused(code, call)
        if rc:
            return rc
    try:
        ctx.close()  # does nothing in the child: the parent's registration stays
        ctx._finalizer()  # what the garbage collector would run: nothing in the child
    except BaseException:
        return 30
    try:
        own = lkf.connect(srv.url, srv.http_url, model, timeout=10)
    except BaseException:
        return 40
    try:
        mine = [t + 1 for t in toks]
        if not own.store(kv, mine) or own.lookup(mine) != len(mine):
            return 41
        got = own.retrieve(mine)
        # Compared as bytes in numpy: torch's OpenMP pool does not survive a fork either.
        if got is None or got.view(torch.uint8).numpy().tobytes() != \
                kv.contiguous().view(torch.uint8).numpy().tobytes():
            return 42
        if own.instance_id == ctx.instance_id:
            return 43
    except BaseException:
        return 44
    finally:
        own.close()
    return 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plane", ["shm", "pickle"])
def test_context_in_forked_child(plane: str, request: pytest.FixtureRequest) -> None:
    """Before: the child's first call hung ~90 s on the parent's sockets."""
    srv: LMCacheServer = request.getfixturevalue(f"server_{plane}")
    m = make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=10)
    try:
        toks = rand_tokens(C)
        kv = m.kv(C, seed=1)
        assert ctx.store(kv, toks)
        assert str(ctx.instance_id) in _registered(srv)
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 99
            try:
                code = _child(ctx, srv, m.name, toks, kv)
            finally:
                os._exit(code)
        code = _wait_child(pid, 60)
        assert code == 0, f"child check failed with exit code {code}"
        # The parent's context is untouched: still registered and working.
        assert str(ctx.instance_id) in _registered(srv)
        assert ctx.lookup(toks) == C
        got = ctx.retrieve(toks)
        assert got is not None and bool((got == kv).all())
        toks2 = rand_tokens(C)
        assert ctx.store(m.kv(C, seed=2), toks2) and ctx.lookup(toks2) == C
        assert ctx.ping()
    finally:
        ctx.close()
    assert str(ctx.instance_id) not in _registered(srv)


_GC_CHILD = """
import gc, os, sys
import lmcache_kv_fast as lkf
from lmcache_kv_fast.transport.http import HttpInfoClient

url, http_url, model = sys.argv[1:4]
# No heartbeat: no background thread whose (inherited, never ending) frame holds the context.
ctx = lkf.connect(url, http_url, model, timeout=10, heartbeat=False)
iid = str(ctx.instance_id)
toks = list(range(1000, 1000 + {c}))
pid = os.fork()
if pid == 0:
    # The child drops the parent's context and exits normally: __del__, the garbage
    # collector, pyzmq's finalizers and interpreter shutdown all run here.
    import weakref
    ref = weakref.ref(ctx)
    del ctx
    gc.collect()
    sys.exit(0 if ref() is None else 3)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status))
regs = HttpInfoClient(http_url, 5).status().get("non_cuda_context_meta") or {{}}
print("REGISTERED", iid in regs)
print("LOOKUP", ctx.lookup(toks))
ctx.close()
regs = HttpInfoClient(http_url, 5).status().get("non_cuda_context_meta") or {{}}
print("UNREGISTERED", iid not in regs)
"""


@pytest.mark.timeout(120)
def test_garbage_collected_in_forked_child_leaves_parent_alone(server_shm: LMCacheServer) -> None:
    """A child that drops the inherited context must not unregister or close the parent's."""
    import subprocess
    import sys

    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=64)
    # Its own session: a hung grandchild (the forked one) is killed with the group.
    proc = subprocess.Popen(
        [sys.executable, "-c", _GC_CHILD.format(c=C), server_shm.url, server_shm.http_url,
         m.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:  # before the fix: the child hung in __del__ / close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the forked child hung while collecting the parent's context")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a forked grandchild left behind
    assert proc.returncode == 0, stderr[-3000:]
    assert "unregister" not in stderr, stderr[-3000:]
    assert stdout.split() == ["CHILD", "0", "REGISTERED", "True", "LOOKUP", "0",
                              "UNREGISTERED", "True"], stdout + stderr[-3000:]
