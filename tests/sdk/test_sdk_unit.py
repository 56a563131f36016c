"""lmcache_kv_fast.sdk without a server: surface vs upstream 0.5.6, URLs, metrics, stream rules.

The stream-bookkeeping tests drive streams with small scripted ``post_completion``
callables (the user's hook position; no engine is imitated): what they check is the
stream's own arithmetic (suffix, done, output tokens, timings, error collection). The
real engine runs in tests/sdk/test_sdk_engine.py.
"""

from __future__ import annotations

import inspect
import io
import threading
import time

import pytest

import lmcache_kv_fast.errors as errors_mod
import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast.errors import InvalidArgumentError, LMCacheSDKError
from lmcache_kv_fast.sdk import batch as sbatch
from lmcache_kv_fast.sdk import metrics as smetrics
from lmcache_kv_fast.sdk import request as sreq
from lmcache_kv_fast.sdk._urls import normalize_request_url

upstream = pytest.importorskip("lmcache.sdk")


# ---------------------------------------------------------------------- surface
UPSTREAM_NAMES = {
    "": ["connect", "LMCacheSDKCacheKind", "batch", "context", "kvcache", "qcache", "request"],
    "context": ["LMCacheSDKContext", "LMCacheSDKError", "ModifyFnType", "LMCacheSDKCacheKind"],
    "kvcache": ["connect"],
    "qcache": ["connect"],
    "request": ["create_request", "LMCacheRequestStream", "LMCacheRequestStreamError",
                "PostCompletion", "StreamPerfMetrics", "TokenEvent"],
    "batch": ["LMCacheBatchedStream", "LMCacheBatchedStreamError"],
}


@pytest.mark.parametrize("mod", sorted(UPSTREAM_NAMES))
def test_every_upstream_name_is_there(mod):
    import importlib

    theirs = importlib.import_module(f"lmcache.sdk{'.' + mod if mod else ''}")
    ours = importlib.import_module(f"lmcache_kv_fast.sdk{'.' + mod if mod else ''}")
    for name in UPSTREAM_NAMES[mod]:
        assert hasattr(theirs, name), (mod, name)
        assert hasattr(ours, name), (mod, name)


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]


@pytest.mark.parametrize("path", [
    "connect", "kvcache.connect", "qcache.connect", "request.create_request",
    "request.LMCacheRequestStream.generate", "request.LMCacheRequestStream.retrieve",
    "request.LMCacheRequestStream.update", "request.LMCacheRequestStream.modify_kv",
    "batch.LMCacheBatchedStream.add", "batch.LMCacheBatchedStream.get_request_stream",
    "batch.LMCacheBatchedStream.run_request_streams",
    "batch.LMCacheBatchedStream.modify_request_streams",
    "batch.LMCacheBatchedStream.get_perf_metrics", "batch.LMCacheBatchedStream.prefill",
    "batch.LMCacheBatchedStream.modify", "batch.LMCacheBatchedStream.decode",
    "context.LMCacheSDKContext.retrieve", "context.LMCacheSDKContext.store",
    "context.LMCacheSDKContext.close", "context.LMCacheSDKContext.register_caches",
])
def test_signatures_match_upstream(path):
    def resolve(root):
        obj = root
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    theirs, ours = _params(resolve(upstream)), _params(resolve(lmc_sdk))
    assert ours == theirs, (path, ours, theirs)


def test_dataclasses_and_properties_match_upstream():
    from dataclasses import fields

    for name in ("StreamPerfMetrics", "TokenEvent"):
        theirs = [f.name for f in fields(getattr(upstream.request, name))]
        ours = [f.name for f in fields(getattr(sreq, name))]
        assert ours[: len(theirs)] == theirs  # ours adds optional fields at the end
    for prop in ("request_stream_id", "suffix_tokens", "decoded_tokens", "output_text",
                 "output_tokens", "is_done"):
        assert isinstance(getattr(sreq.LMCacheRequestStream, prop), property)
    for prop in ("kind", "chunk_size", "mq_timeout"):
        assert isinstance(getattr(lmc_sdk.LMCacheSDKContext, prop), property)


def test_cache_kind_matches_upstream():
    theirs = upstream.LMCacheSDKCacheKind
    ours = lmc_sdk.LMCacheSDKCacheKind
    assert [k.value for k in ours] == [k.value for k in theirs]
    for kt, ko in zip(theirs, ours):
        for m in ("m", "org/model-7b", "x##query"):
            assert ko.server_model_name(m) == kt.server_model_name(m)
            assert ko.base_model_name(m) == kt.base_model_name(m)
    assert lmc_sdk.context.as_kind("QUERY") is ours.QUERY
    with pytest.raises(ValueError, match="unsupported cache kind"):
        lmc_sdk.connect("values", "tcp://127.0.0.1:1", "http://127.0.0.1:1", "m")


def test_lmcache_sdk_error_is_the_root():
    classes = [c for c in vars(errors_mod).values()
               if isinstance(c, type) and issubclass(c, BaseException)]
    assert len(classes) >= 7
    for cls in [*classes, sreq.LMCacheRequestStreamError, sbatch.LMCacheBatchedStreamError,
                lmc_sdk.hooks.EngineHookError, lmc_sdk.qcache.__dict__.get("QueryLayoutError",
                                                                           LMCacheSDKError)]:
        assert issubclass(cls, LMCacheSDKError), cls
    from lmcache_kv_fast.sdk._qlayout import QueryLayoutError

    assert issubclass(QueryLayoutError, LMCacheSDKError)
    assert lmc_sdk.LMCacheSDKError is lmc_sdk.context.LMCacheSDKError is LMCacheSDKError


# ---------------------------------------------------------------------- URLs
@pytest.mark.parametrize(("given", "want"), [
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    ("127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    ("localhost:6000", "tcp://localhost:6000"),
    ("TCP://h:1", "tcp://h:1"),
    ("ipc:///tmp/x.sock", "ipc:///tmp/x.sock"),
    ("IPC:///tmp/x.sock", "ipc:///tmp/x.sock"),
])
def test_request_urls_like_upstream(given, want):
    assert normalize_request_url(given) == want
    from lmcache.v1.multiprocess.transport.factory import _normalize_server_url

    assert _normalize_server_url(given)[1].lower() == want.lower()


@pytest.mark.parametrize(("url", "why"), [
    ("inproc://x", "inside one process"),
])
def test_refused_url_schemes_say_why(url, why):
    with pytest.raises(InvalidArgumentError, match=why):
        normalize_request_url(url)


@pytest.mark.parametrize(("given", "want"), [
    ("grpc://h:1", "grpc://h:1"), ("GRPC://h:1", "grpc://h:1"),
    ("grpc+unix:///tmp/s", "grpc+unix:///tmp/s"),
])
def test_grpc_urls_are_kept(given, want):  # --transport grpc servers (docs/protocol.md §12)
    assert normalize_request_url(given) == want


def test_bad_urls_refused_before_contact():
    with pytest.raises(InvalidArgumentError, match="url must"):
        lmc_sdk.kvcache.connect("tcp://h", "http://127.0.0.1:1", "m")
    with pytest.raises(InvalidArgumentError, match="url must be a str"):
        lmc_sdk.kvcache.connect(5555, "http://127.0.0.1:1", "m")


# ---------------------------------------------------------------------- metrics
def _fill(m):
    m.add("status", "Status", "OK")
    s = m.add_section("config", "Configuration")
    s.add("num_request_streams", "Number of Request Streams", 16)
    r = m.add_section("results", "Results")
    r.add("duration", "Total Duration (s)", 1.23456)
    r.add("none", "Nothing", None)
    t = m.add_table("rows", "Rows", ("name", "Name"), ("size", "Size"))
    t.add_row(name="a", size=1.5)
    t.add_row(name="bb", size="10 MiB")
    g = m.add_list_section("models", "m0", "Model 0")
    g.add("id", "Id", "x")


@pytest.mark.parametrize("width", [48, 80])
def test_metrics_render_like_upstream(width):
    from lmcache.cli.metrics import Metrics as TheirMetrics
    from lmcache.cli.metrics import StreamHandler as TheirHandler
    from lmcache.cli.metrics import get_formatter as their_fmt

    theirs, ours = TheirMetrics("Title"), smetrics.Metrics("Title")
    _fill(theirs)
    _fill(ours)
    for fmt in ("terminal", "json"):
        tb, ob = io.StringIO(), io.StringIO()
        theirs.add_handler(TheirHandler(their_fmt(fmt, width=width), stream=tb))
        ours.add_handler(smetrics.StreamHandler(smetrics.get_formatter(fmt, width=width),
                                                stream=ob))
        theirs.emit()
        ours.emit()
        assert ob.getvalue() == tb.getvalue()
        theirs._handlers.clear()
        ours._handlers.clear()
    assert ours.to_dict() == theirs.to_dict()
    with pytest.raises(ValueError):
        ours.add_section("config", "again")
    with pytest.raises(ValueError, match="Unknown format"):
        smetrics.get_formatter("xml")


def test_percentile():
    import statistics

    xs = [0.5, 0.1, 0.3, 0.9, 0.7]
    assert sbatch.percentile(xs, 50) == statistics.median(xs)
    assert sbatch.percentile(xs, 90) == pytest.approx(0.82)
    assert sbatch.percentile([], 50) is None
    assert sbatch.percentile([2.0], 90) == 2.0


# ---------------------------------------------------------------------- streams (no server)
class Scripted:
    """A post_completion hook that answers from a script (the user's hook position)."""

    def __init__(self, tokens_per_call=3, finish=None, fail_on=(), delay=0.0):
        self.tokens_per_call, self.finish, self.fail_on = tokens_per_call, finish, set(fail_on)
        self.delay = delay
        self.calls: list[tuple[list[int], dict, str]] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def __call__(self, prompt, params, salt):
        self.calls.append((list(prompt), dict(params), salt))
        n = min(self.tokens_per_call, params.get("max_tokens", self.tokens_per_call))
        return self._gen(prompt, n)

    def _gen(self, prompt, n):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            for i in range(n):
                time.sleep(self.delay)
                if prompt[0] in self.fail_on and i == min(1, n - 1):
                    raise RuntimeError(f"engine fell over on {prompt[0]}")
                fin = self.finish if i == n - 1 else None
                yield sreq.TokenEvent(100 + i, f"t{i}", fin)
        finally:
            with self._lock:
                self.active -= 1


def test_generate_bookkeeping():
    hook = Scripted(tokens_per_call=3)
    s = sreq.create_request([], hook, [1, 2, 3], cache_salt="s")
    m = s.generate({"max_tokens": 5})
    assert hook.calls[0] == ([1, 2, 3], {"max_tokens": 5}, "s")
    assert s.tokens == [1, 2, 3, 100, 101, 102]
    assert s.output_tokens == [100, 101, 102]  # generated only (0.5.6: every token)
    assert s.decoded_tokens == 3 and s.output_text == "t0t1t2"
    assert s.is_done  # 3 < max_tokens 5: ended early (0.5.6's rule)
    assert (m.input_tokens, m.output_tokens) == (3, 3)
    assert len(m.tpot) == 2 and m.ttft >= 0 and m.duration >= m.ttft
    # apply_edit: the tail past the cached prefix is re-sent on the next pass
    s.apply_edit(4, [7, 8])
    assert s.tokens == [7, 8] and s.suffix_tokens == [101, 102] and not s.is_done
    s.generate({"max_tokens": 3}, suffix_tokens=[9])
    assert hook.calls[1][0] == [7, 8, 101, 102, 9]
    assert s.suffix_tokens == [] and not s.is_done  # 3 == max_tokens
    assert s.output_tokens == [100, 101, 102, 100, 101, 102]


@pytest.mark.parametrize(("finish", "max_tokens", "done"), [
    ("stop", 10, True), ("length", 3, False), ("stop", None, True),
    (None, None, False), (None, 3, False), (None, 4, True)])
def test_done_rule(finish, max_tokens, done):
    s = sreq.create_request([], Scripted(3, finish=finish), [1])
    s.generate({} if max_tokens is None else {"max_tokens": max_tokens})
    assert s.is_done is done


def test_generate_error_keeps_partial_tokens():
    s = sreq.create_request([], Scripted(3, fail_on=[5]), [5, 6])
    with pytest.raises(sreq.LMCacheRequestStreamError, match="engine fell over on 5") as ei:
        s.generate({"max_tokens": 3})
    assert isinstance(ei.value, LMCacheSDKError)
    assert s.tokens == [5, 6, 100] and s.output_tokens == [100]


def test_bad_stream_arguments():
    with pytest.raises(TypeError, match="post_completion must be callable"):
        sreq.create_request([], None, [1])
    with pytest.raises(ValueError):
        sreq.create_request([], Scripted(), [-1])
    with pytest.raises(TypeError, match="LMCacheSDKContext"):
        sreq.create_request([object()], Scripted(), [1])
    s = sreq.create_request([], Scripted(), [1])
    with pytest.raises(sreq.LMCacheRequestStreamError, match="no context for cache kind"):
        s.retrieve(lmc_sdk.LMCacheSDKCacheKind.KV)
    with pytest.raises(sreq.LMCacheRequestStreamError, match="TokenEvent"):
        sreq.create_request([], lambda p, sp, salt: ["x"], [1]).generate({})


def test_batch_passes_bounded_skip_done_and_report_every_error():
    hook = Scripted(tokens_per_call=2, delay=0.02, fail_on=[3, 7])
    b = sbatch.LMCacheBatchedStream(max_concurrency=3)
    streams = [sreq.create_request([], hook, [i, 0]) for i in range(10)]
    for s in streams:
        b.add(s)
    with pytest.raises(sbatch.LMCacheBatchedStreamError) as ei:
        b.prefill({"temperature": 0.0})
    err = ei.value
    assert set(err.errors) == {streams[3].request_stream_id, streams[7].request_stream_id}
    assert "engine fell over on 3" in str(err) and "engine fell over on 7" in str(err)
    assert hook.max_active <= 3
    assert all(c[1]["max_tokens"] == 1 for c in hook.calls)
    rep = err.metrics.to_dict()
    assert rep["title"] == "Batched Stream Metrics (prefill)"
    assert rep["metrics"]["config"]["num_request_streams"] == 10
    assert rep["metrics"]["config"]["num_streams_run"] == 8
    assert rep["metrics"]["results"]["input_tokens"] == 16
    # a finished stream is skipped by the next pass
    streams[0].done = True
    hook.fail_on.clear()
    n_calls = len(hook.calls)
    rep = b.decode({"max_tokens": 2}, stream_ids=[s.request_stream_id for s in streams[:4]])
    assert len(hook.calls) == n_calls + 3
    d = rep.to_dict()["metrics"]
    assert d["config"] == {"num_request_streams": 4, "num_streams_run": 3,
                           "num_streams_skipped": 1}
    assert d["results"]["output_tokens"] == 6
    assert d["latency"]["tpot_p50_ms"] >= 0 and d["latency"]["ttft_p90_ms"] >= 0
    with pytest.raises(sbatch.LMCacheBatchedStreamError, match="does not exist"):
        b.run_request_streams({}, stream_ids=["nope"])
    with pytest.raises(sbatch.LMCacheBatchedStreamError, match="already exists"):
        b.add(streams[0])
    with pytest.raises(sbatch.LMCacheBatchedStreamError, match="Invalid mode"):
        b.get_perf_metrics(1.0, "terminal", 80, "nope")
    assert sbatch.LMCacheBatchedStream().run_request_streams({}) == 0.0
