"""Faults with the real server: SIGKILL during a large store / retrieve, restart, and
clients SIGKILLed between prepare_store and commit_store or right after connect (reaped by
the server, never exposing a byte that is not the KV).

One SHM server serves the module (reap timeout 30 s, registration grace 50 s, write TTL
40 s: a pinged instance is reaped while a reservation made just before its death is still
live, a never-pinged one only after that reservation expired); tests that kill it restart
it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import Model, make_model, rand_tokens, start_server
from fake_peer import mappings
from rel_helpers import (
    install_frame_watch,
    one_frame_messages,
    wait_clean,
    wait_until,
)

import lmcache_kv_fast as lkf
from lmcache_kv_fast.testing import LMCacheServer

C = 256
TIMEOUT = 5.0
SLACK = 3.0  # cleanup after a timeout (short waits) + the /status diagnosis on a busy box
LAYERS = 32  # 32 MiB per chunk object (bf16, 8 heads x 128)
CHUNKS = 4
REAP_S, GRACE_S, WRITE_TTL_S = 30, 50, 40
REAP_SCAN_S = REAP_S / 4  # the reaper scans this often

install_frame_watch()


@pytest.fixture(scope="module")
def fault_server() -> Iterator[LMCacheServer]:
    yield from start_server(True, l1_size_gb=1.0,
                            extra_args=["--worker-reap-timeout-seconds", str(REAP_S),
                                        "--worker-registration-grace-seconds", str(GRACE_S),
                                        "--l1-write-ttl-seconds", str(WRITE_TTL_S)])
    assert one_frame_messages() == []


def _up(srv: LMCacheServer) -> LMCacheServer:
    if srv.proc is None or srv.proc.poll() is not None:
        srv.restart()
    return srv


def _kill_during(srv: LMCacheServer, op: Callable[[int], None], delay: float
                 ) -> tuple[BaseException, float, list[float], int]:
    """Run ``op(i)`` back to back; once one succeeded, SIGKILL the server ``delay`` s later
    (so mid-operation); return the error, the seconds from the kill to the error, every
    op's duration and how many ops succeeded."""
    killed_at: list[float] = []

    def killer() -> None:
        killed_at.append(time.monotonic())
        srv.kill()

    timer = threading.Timer(delay, killer)
    durations: list[float] = []
    ok = 0
    try:
        for i in range(10_000):
            t0 = time.monotonic()
            try:
                op(i)
            except BaseException as err:  # checked by the caller
                durations.append(time.monotonic() - t0)
                timer.join()
                assert killed_at, f"op {i} failed before the kill: {err!r}"
                return err, time.monotonic() - killed_at[0], durations, ok
            durations.append(time.monotonic() - t0)
            ok += 1
            if ok == 1:
                timer.start()
            if killed_at and time.monotonic() - killed_at[0] > 4 * TIMEOUT:
                break
    finally:
        timer.cancel()
        if timer.is_alive():
            timer.join()
    raise AssertionError(f"{ok} operations succeeded after the server was killed")


def _after_restart_says_reconnect(srv: LMCacheServer, ctx: lkf.LMCacheKVCacheContext,
                                  m: Model) -> None:
    srv.restart()
    for attempt in (ctx.store, ctx.retrieve):  # the first and every later operation
        t0 = time.monotonic()
        with pytest.raises(lkf.KVCacheSDKError, match="reconnect") as ei:
            if attempt == ctx.store:
                ctx.store(m.kv(C), rand_tokens(C, seed=99))
            else:
                ctx.retrieve(rand_tokens(C, seed=99))
        assert time.monotonic() - t0 < TIMEOUT + SLACK
        assert "restarted" in str(ei.value)


def _closed_and_unmapped(srv: LMCacheServer, ctx: lkf.LMCacheKVCacheContext) -> None:
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 < 2.0
    assert mappings(srv.pool_segment) == 0, "the SHM mapping outlived close()"
    with pytest.raises(lkf.ContextClosedError):
        ctx.lookup(rand_tokens(C))


def _fresh_connect_works(srv: LMCacheServer, name: str) -> None:
    m = make_model(srv, name=name, num_layers=2, num_kv_heads=2, head_size=64)
    with lkf.connect(srv.url, srv.http_url, m.name, timeout=TIMEOUT) as ctx:
        toks, kv = rand_tokens(2 * C, seed=7), m.kv(2 * C, seed=7)
        assert ctx.store(kv, toks)
        got = ctx.retrieve(toks)
        assert got is not None and torch.equal(got, kv)
    assert not any(wait_clean(srv).values())


def test_sigkill_during_large_store(fault_server: LMCacheServer) -> None:
    srv = _up(fault_server)
    m = make_model(srv, num_layers=LAYERS)
    kv = m.kv(CHUNKS * C, seed=1)
    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=TIMEOUT)
    try:
        assert ctx.transport == "shm" and mappings(srv.pool_segment) == 1
        results: list[bool] = []
        err, after_kill, durations, ok = _kill_during(
            srv, lambda i: results.append(ctx.store(kv, rand_tokens(CHUNKS * C, seed=1000 + i))),
            delay=0.1)
        print(f"store: {ok} ok before the kill, error {after_kill:.2f}s after it, "
              f"op durations {[round(d, 2) for d in durations]}: {err!r:.200}")
        assert isinstance(err, lkf.KVCacheSDKError), repr(err)
        assert "no reply" in str(err) or "restarted" in str(err)
        assert max(durations) < TIMEOUT + SLACK, durations
        assert after_kill < 2 * (TIMEOUT + SLACK)  # the op in flight, at worst one more
        assert ok >= 1 and all(results)  # stores before the kill were honest successes
        _after_restart_says_reconnect(srv, ctx, m)
        _closed_and_unmapped(srv, ctx)
    finally:
        ctx.close()
    _fresh_connect_works(srv, m.name)


def test_sigkill_during_large_retrieve(fault_server: LMCacheServer) -> None:
    srv = _up(fault_server)
    m = make_model(srv, num_layers=LAYERS)
    toks, kv = rand_tokens(CHUNKS * C, seed=2), m.kv(CHUNKS * C, seed=2)
    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=TIMEOUT)
    try:
        assert ctx.store(kv, toks)
        out = torch.empty_like(kv)
        mismatches = []

        def op(i: int) -> None:
            got = ctx.retrieve(toks, out=out)
            if got is None or not torch.equal(got, kv):
                mismatches.append(i)

        err, after_kill, durations, ok = _kill_during(srv, op, delay=0.05)
        print(f"retrieve: {ok} ok before the kill, error {after_kill:.2f}s after it, "
              f"op durations {[round(d, 2) for d in durations]}: {err!r:.200}")
        assert isinstance(err, lkf.KVCacheSDKError), repr(err)
        assert mismatches == []  # whatever returned before the error was the stored data
        assert max(durations) < TIMEOUT + SLACK, durations
        assert after_kill < 2 * (TIMEOUT + SLACK)
        assert ok >= 1
        _after_restart_says_reconnect(srv, ctx, m)
        _closed_and_unmapped(srv, ctx)
    finally:
        ctx.close()
    _fresh_connect_works(srv, m.name)


_CHILD_MID_STORE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from conftest import Model, rand_tokens
    import torch
    import lmcache_kv_fast as lkf
    from lmcache_kv_fast.copy.select import backend

    ctx = lkf.connect({url!r}, {http!r}, {name!r}, timeout=10)
    assert ctx.ping()  # ping-proven (the heartbeat pings too)
    be = backend()
    def hang(*a, **k):  # prepare_store answered, slots reserved: die before commit
        print("READY", ctx.instance_id, ctx.writer_instance_id, flush=True)
        time.sleep(600)
    be.scatter = hang
    ctx.store(torch.zeros(2, 2, 2 * 256, 128, dtype=torch.bfloat16), rand_tokens(512, seed=3))
""")

_CHILD_JUST_CONNECTED = textwrap.dedent("""
    import time
    import lmcache_kv_fast as lkf

    ctx = lkf.connect({url!r}, {http!r}, {name!r}, timeout=10)
    print("READY", ctx.instance_id, ctx.writer_instance_id, flush=True)
    time.sleep(600)  # killed long before its first heartbeat interval
""")


def _start_child(code: str) -> tuple[subprocess.Popen[str], str, str]:
    """Run ``code``; return the process and the reader / writer ids it printed."""
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": str(Path(tests).parent)}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    line = ""
    deadline = time.monotonic() + 60
    while not line.startswith("READY") and time.monotonic() < deadline:
        line = child.stdout.readline() if child.stdout else ""
        if not line and child.poll() is not None:
            break
    if not line.startswith("READY"):
        child.kill()
        _, err = child.communicate(10)
        raise AssertionError(f"child did not get ready: {err[-2000:]}")
    _, reader, writer = line.split()
    return child, reader, writer


def _regs(srv: LMCacheServer) -> set[str]:
    return set(srv.status()["non_cuda_context_meta"])


def _nothing_visible(srv: LMCacheServer, m: Model, toks: list[int]) -> None:
    time.sleep(1.0)  # /status drops a reaped id just before the reaper releases its slots
    # (the test's vLLM-like registration is never pinged either: reaped after the grace)
    make_model(srv, name=m.name, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
               head_size=m.head_size)
    with lkf.connect(srv.url, srv.http_url, m.name, timeout=TIMEOUT) as ctx:
        assert ctx.lookup(toks) == 0, "unwritten slots became visible"
        assert ctx.retrieve(toks) is None


@pytest.mark.slow
def test_dead_clients_are_reaped_and_never_expose_unwritten_slots(
        fault_server: LMCacheServer) -> None:
    """A client SIGKILLed between prepare_store and commit_store, and one SIGKILLed right
    after connect (before its first heartbeat interval):

    * both readers are reaped after the reap timeout (pinged at connect), releasing what
      they held;
    * the dying store's reservation is never visible: its writer is never pinged, so it is
      reaped only after the registration grace, when the reservation's write TTL has run
      out and the reap cannot admit it (a pinged writer would have been reaped ~30 s in,
      with the reservation live: 1 chunk of zeros visible, docs/server-defects.md);
    * another client reads a miss for those tokens, never other bytes, and works.
    """
    srv = _up(fault_server)
    m = make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
    toks = rand_tokens(512, seed=3)  # what the mid-store child stores
    fmt = {"url": srv.url, "http": srv.http_url, "name": m.name,
           "tests": str(Path(__file__).resolve().parents[1])}
    children = []
    try:
        mid, mid_reader, mid_writer = _start_child(_CHILD_MID_STORE.format(**fmt))
        children.append(mid)
        early, early_reader, early_writer = _start_child(_CHILD_JUST_CONNECTED.format(**fmt))
        children.append(early)
        for c in children:
            c.send_signal(signal.SIGKILL)
            assert c.wait(10) == -signal.SIGKILL
        killed = time.monotonic()
        assert {mid_reader, mid_writer, early_reader, early_writer} <= _regs(srv)
        assert srv.status()["storage_manager"]["l1_manager"]["write_locked_count"] >= 2
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait(10)
            for f in (c.stdout, c.stderr):
                if f is not None:
                    f.close()
    # the readers: reaped REAP_S..REAP_S + REAP_SCAN_S after their last ping
    assert wait_until(lambda: not {mid_reader, early_reader} & _regs(srv),
                      timeout=REAP_S + REAP_SCAN_S + 5), "a dead client's reader was not reaped"
    assert mid_writer in _regs(srv)  # never pinged: judged against the grace
    _nothing_visible(srv, m, toks)
    # the writers: reaped GRACE_S..GRACE_S + REAP_SCAN_S after their last request; the
    # reservation (WRITE_TTL_S < GRACE_S) expired before: finish_write refuses it
    left_s = GRACE_S + REAP_SCAN_S + 10 - (time.monotonic() - killed)
    assert wait_until(lambda: not {mid_writer, early_writer} & _regs(srv), timeout=left_s)
    _nothing_visible(srv, m, toks)
    l1 = srv.status()["storage_manager"]["l1_manager"]
    assert l1["write_locked_count"] == 0, l1  # (the expired buffer stays staged until reused)
    # a new client works, on those tokens too (it is handed the expired buffer)
    with lkf.connect(srv.url, srv.http_url, m.name, timeout=TIMEOUT) as ctx:
        for t, seed in ((rand_tokens(2 * C, seed=4), 4), (toks, 5)):
            kv = m.kv(len(t), seed=seed)
            assert ctx.store(kv, t)
            got = ctx.retrieve(t)
            assert got is not None and torch.equal(got, kv)


def test_store_into_a_full_dev_shm_is_an_error_not_a_crash() -> None:
    """/dev/shm cannot give the pool a page (ENOSPC, injected at the UFFDIO_COPY fill and
    at the pwritev the cold-store path continues with; a fault through the mapping would
    be SIGBUS): that store fails with a KVCacheSDKError saying so; the process and the
    context go on."""
    from benches.harness.helpers import punch_segment
    from lmcache_kv_fast import _native

    with LMCacheServer(shm=True, l1_size_gb=0.0625) as srv:
        m = make_model(srv, num_layers=4)
        with lkf.connect(srv.url, srv.http_url, m.name, timeout=TIMEOUT) as ctx:
            assert punch_segment(f"/dev/shm/{srv.pool_segment}")  # L1 empty: all pages fresh
            try:
                _native._set_uffd_fault(28)  # ENOSPC (when userfaultfd fills are used)
                _native._set_file_write_fault(28)
                with pytest.raises(lkf.KVCacheSDKError, match="full") as ei:
                    ctx.store(m.kv(2 * C, seed=1), rand_tokens(2 * C, seed=1))
                assert "/dev/shm/" in str(ei.value)
            finally:
                _native._set_file_write_fault(0)
                _native._set_uffd_fault(0)
            toks = rand_tokens(2 * C, seed=2)
            assert ctx.store(m.kv(2 * C, seed=2), toks)
            assert torch.equal(ctx.retrieve(toks), m.kv(2 * C, seed=2))
