"""lmcache_kv_fast.sdk driving a real vLLM CPU engine: prefill → modify → decode.

A batch of streams is prefilled by vLLM (OpenAI-compatible server, and the offline
engine through the in-process hook), every 10th token's K/V is dropped from each cached
prompt, and the streams decode from the edited cache: the engine reports the edited
prefixes as external (LMCache) hits, the edits equal upstream's byte for byte, and the
greedy outputs equal those of upstream's ``lmcache.sdk.batch`` run on the same inputs and
engine, or part first at a near-tie of the engine's own logits (tests/sdk/greedy.py).
Upstream needs a harness around it on a CPU engine: testbed/upstream_cpu.py. An unchanged
0.5.6 program (tests/sdk/programs/token_dropping_056.py) runs with either import line.

The runs use distinct cache salts, so no run can read another's edits (vLLM's prefix
cache and LMCache both keep salts apart).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import skip_on_057
from engine_fixtures import CHUNK

import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast.layout import select_cpu_kernel
from lmcache_kv_fast.sdk.hooks import EngineHookError, OpenAICompletions
from testbed.upstream_cpu import cpu_engine_kv, upstream_on_cpu_engine

from .greedy import assert_same_greedy
from .http_delay_proxy import HttpDelayProxy

upstream = pytest.importorskip("lmcache.sdk")

HERE = Path(__file__).parent
PROGRAM = HERE / "programs" / "token_dropping_056.py"
KV = lmc_sdk.LMCacheSDKCacheKind.KV
SP = {"temperature": 0.0, "ignore_eos": True}
MAX_TOKENS = 8
LENGTHS = (600, 777, 1024, 1300, 1500)


def tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def drop_every_10th(tensors, toks):
    kv = tensors[KV]
    keep = [i for i in range(kv.shape[-2]) if i % 10 != 9]
    return kv.index_select(kv.dim() - 2, torch.tensor(keep)), [toks[i] for i in keep]


def whole(n: int) -> int:
    return n // CHUNK * CHUNK


def external_hits(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if "external_prefix_cache_hits" in k)


def kernel() -> str:
    return select_cpu_kernel(torch.bfloat16, 128, 64)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [tokens(n, 700 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def ours(openai_engine, engine_server, model_name, prompts):
    """Our batched stream on the OpenAI server (hook: OpenAICompletions), salt 'ours'."""
    before = openai_engine.metrics()
    ctx = lmc_sdk.connect(KV, engine_server.url, engine_server.http_url, model_name)
    try:
        hook = OpenAICompletions(openai_engine.url)
        batch = lmc_sdk.batch.LMCacheBatchedStream(max_in_flight=2)
        streams = [lmc_sdk.request.create_request([ctx], hook, p, cache_salt="ours")
                   for p in prompts]
        for s in streams:
            batch.add(s)
        pre = batch.prefill(SP)
        prefill_cached = [batch.perf_metrics[s.request_stream_id].cached_tokens for s in streams]
        mod = batch.modify(drop_every_10th)
        edited = [list(s.tokens) for s in streams]
        suffixes = [list(s.suffix_tokens) for s in streams]
        dec = batch.decode({**SP, "max_tokens": MAX_TOKENS})
        decode_cached = [batch.perf_metrics[s.request_stream_id].cached_tokens for s in streams]
    finally:
        ctx.close()
    return {"streams": streams, "edited": edited, "suffixes": suffixes,
            "prefill_cached": prefill_cached, "decode_cached": decode_cached,
            "reports": (pre, mod, dec), "hits": external_hits(openai_engine.metrics())
            - external_hits(before)}


def test_decode_reads_the_edited_prefixes_as_external_hits(ours, prompts):
    pre, mod, dec = ours["reports"]
    assert ours["prefill_cached"] == [0] * len(prompts)
    expect = []
    for p, s, edited, suffix in zip(prompts, ours["streams"], ours["edited"], ours["suffixes"]):
        cached = whole(len(p))  # the engine stored the prompt's whole chunks
        keep = [i for i in range(cached) if i % 10 != 9]
        assert edited == [p[i] for i in keep]
        assert suffix == [*p[cached:], s.output_tokens[0]]  # tail + the prefill's token
        assert len(s.output_tokens) == 1 + MAX_TOKENS  # generated only (0.5.6: all tokens)
        expect.append(whole(len(edited)))
    assert all(expect) and ours["decode_cached"] == expect
    # never-computed token sequences: every cached token came from LMCache
    assert ours["hits"] >= sum(expect)
    m = mod.to_dict()["metrics"]
    assert m["results"]["streams_modified"] == len(prompts) and m["results"]["streams_failed"] == 0
    assert m["results"]["peak_in_flight"] <= 2
    assert m["results"]["tokens_before"] == sum(whole(len(p)) for p in prompts)
    d = dec.to_dict()["metrics"]
    assert d["results"]["output_tokens"] == MAX_TOKENS * len(prompts)
    assert d["latency"]["ttft_p50_ms"] > 0 and d["latency"]["tpot_p90_ms"] > 0
    assert pre.to_dict()["metrics"]["results"]["input_tokens"] == sum(map(len, prompts))


def _upstream_program():
    spec = importlib.util.spec_from_file_location("token_dropping_056", PROGRAM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports lmcache.sdk: the upstream program's hook and edit
    return mod


def test_stream_kv_flat_and_per_chunk_paths_agree(ours, engine_server, model_name,
                                                  monkeypatch):
    """The modify's two ways through a CPU engine's rows agree byte for byte: the flat row
    buffer (small chunks, the tiny model) and the core's per-chunk conversion (chunks from
    ``FLAT_MAX_CHUNK_BYTES``, forced here), for reads and for stores."""
    from lmcache_kv_fast.sdk import _kvio as kvio

    ctx = lmc_sdk.connect(KV, engine_server.url, engine_server.http_url, model_name)
    try:
        flat = kvio.StreamKV(ctx)
        monkeypatch.setattr(kvio, "FLAT_MAX_CHUNK_BYTES", 0)
        chunked = kvio.StreamKV(ctx)
        assert flat._cpu is not None and chunked._cpu is None
        toks = ours["edited"][0]
        a, b = flat.read(toks, "ours"), chunked.read(toks, "ours")
        assert a is not None and b is not None and a.shape[2] == whole(len(toks))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        edit = a.flip(2).contiguous()  # other bytes than the engine's, same geometry
        for i, (writer, reader) in enumerate(((chunked, flat), (flat, chunked))):
            salt = f"kvio-paths-{i}"
            assert writer.store(edit, toks[: edit.shape[2]], salt).tokens_stored == edit.shape[2]
            back = reader.read(toks[: edit.shape[2]], salt)
            assert back is not None and torch.equal(back.view(torch.int16), edit.view(torch.int16))
    finally:
        ctx.close()


@skip_on_057("the reference is upstream 0.5.6's SDK run in this process, which does not "
             "speak a 0.5.7 server's dialect")
def test_greedy_outputs_equal_upstream_batch(ours, openai_engine, engine_server, model_name,
                                             prompts):
    prog = _upstream_program()
    hook = prog.make_post_completion(openai_engine.url, model_name)
    with upstream_on_cpu_engine(engine_server.url, model_name,
                                cpu_engine_kv(model_name, kernel())):
        ctx = upstream.connect(upstream.LMCacheSDKCacheKind.KV, engine_server.url,
                               engine_server.http_url, model_name)
        try:
            batch = upstream.batch.LMCacheBatchedStream()
            streams = [upstream.request.create_request([ctx], hook, p, cache_salt="upstream")
                       for p in prompts]
            for s in streams:
                batch.add(s)
            batch.prefill(SP)
            batch.modify(prog.drop_every_10th)
            batch.decode({**SP, "max_tokens": MAX_TOKENS})
        finally:
            ctx.close()
    # edited prompt + tail + every generated token
    tails = [len(e) + len(p) - whole(len(p)) for e, p in zip(ours["edited"], prompts)]
    assert_same_greedy(openai_engine, "ours", ([s.tokens for s in ours["streams"]],
                                               [s.tokens for s in streams]), prompts, tails)


@skip_on_057("the reference is upstream 0.5.6's SDK run in this process, which does not "
             "speak a 0.5.7 server's dialect")
def test_existing_056_program_runs_unchanged(tmp_path, openai_engine, engine_server, model_name,
                                             prompts):
    source = PROGRAM.read_text()
    assert source.count("import lmcache.sdk as lmc_sdk\n") == 1
    ported = tmp_path / "token_dropping_ours.py"
    ported.write_text(source.replace("import lmcache.sdk as lmc_sdk\n",
                                     "import lmcache_kv_fast.sdk as lmc_sdk\n"))
    pfile = tmp_path / "prompts.json"
    pfile.write_text(json.dumps(prompts[:3]))

    def run(cmd: list[str], salt: str) -> list[list[int]]:
        out = tmp_path / f"{salt}.json"
        args = ["--url", engine_server.url, "--http-url", engine_server.http_url,
                "--model", model_name, "--vllm-url", openai_engine.url, "--prompts", str(pfile),
                "--salt", salt, "--max-tokens", str(MAX_TOKENS), "--out", str(out)]
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600,
                              cwd=HERE.parents[1])
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "Batched Stream Modify Metrics" in proc.stdout  # .emit() printed the reports
        return json.loads(out.read_text())["tokens"]

    start = external_hits(openai_engine.metrics())
    theirs = run([sys.executable, "-m", "testbed.upstream_cpu",
                  engine_server.url, model_name, kernel(), str(PROGRAM)], "prog-upstream")
    before = external_hits(openai_engine.metrics())
    mine = run([sys.executable, str(ported)], "prog-ours")
    hits = external_hits(openai_engine.metrics()) - before
    edited = [[p[i] for i in range(whole(len(p))) if i % 10 != 9] for p in prompts[:3]]
    want = sum(whole(len(e)) for e in edited)
    assert hits >= want > 0 and before - start >= want  # both decodes read their whole edit
    ctx = lmc_sdk.connect(KV, engine_server.url, engine_server.http_url, model_name)
    try:  # both programs stored the same bytes under their salts
        for e in edited:
            a, b = (ctx.retrieve(e, salt) for salt in ("prog-upstream", "prog-ours"))
            assert a is not None and b is not None and a.shape[-2] == whole(len(e))
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    finally:
        ctx.close()
    tails = [len(e) + len(p) - whole(len(p)) for e, p in zip(edited, prompts)]
    assert_same_greedy(openai_engine, "prog-ours", (mine, theirs), prompts, tails)


def test_greedy_comparison_rejects_what_is_no_tie(ours, openai_engine, prompts):
    """The near-tie rule of the comparisons above fails a run whose token the engine
    scores far below its best (here: its worst token at the last position)."""
    toks = list(ours["streams"][0].tokens)
    lp = openai_engine.complete(toks[:-1], logprobs=1024, cache_salt="ours").logprobs[0]
    worst = int(lp.argmin())
    assert worst != toks[-1]
    tails = [len(e) + len(p) - whole(len(p)) for e, p in zip(ours["edited"], prompts)]
    with pytest.raises(AssertionError, match="not a tie"):
        assert_same_greedy(openai_engine, "ours", ([toks], [[*toks[:-1], worst]]), prompts,
                           tails)
    assert_same_greedy(openai_engine, "ours", ([toks], [list(toks)]), prompts, tails)


def test_in_process_vllm_hook(offline_engine, openai_engine, engine_server, prompts, ours):
    res = offline_engine.sdk_workflow(url=engine_server.url, http_url=engine_server.http_url,
                                      prompts=prompts, salt="inproc", max_tokens=MAX_TOKENS,
                                      sampling_params=SP)
    assert res["edited"] == ours["edited"]
    assert res["decode_cached"] == [whole(len(e)) for e in ours["edited"]]
    assert [len(o) for o in res["output_tokens"]] == [1 + MAX_TOKENS] * len(prompts)
    # the same greedy outputs as the OpenAI server's run (same model, same edits)
    tails = [len(e) + len(p) - whole(len(p)) for e, p in zip(ours["edited"], prompts)]
    assert_same_greedy(openai_engine, "ours", ([s.tokens for s in ours["streams"]],
                                               res["tokens"]), prompts, tails)
    dec = res["reports"]["decode"]["metrics"]
    assert dec["latency"]["tpot_p50_ms"] is not None and dec["latency"]["tpot_p50_ms"] > 0


def test_openai_hook_errors_are_clear(openai_engine, model_name):
    from lmcache_kv_fast.testing.server import free_port

    ok = OpenAICompletions(openai_engine.url)
    with pytest.raises(EngineHookError, match="HTTP 404"):
        list(OpenAICompletions(openai_engine.url, model="no-such-model")([5, 6], SP, ""))
    with pytest.raises(EngineHookError, match="failed: ConnectionError"):
        list(OpenAICompletions(f"http://127.0.0.1:{free_port()}", model="m")([5, 6], SP, ""))
    with pytest.raises(EngineHookError, match="HTTP 400"):
        list(ok(tokens(3000, 1), {**SP, "max_tokens": 4}, ""))
    # timeouts through a proxy that holds the engine's reply but lets its requests run to
    # their end: closing the connection would abort the request, and an abort can kill
    # the shared engine (an upstream race: http_delay_proxy.py)
    with (HttpDelayProxy("127.0.0.1", openai_engine.port, delay=3.0) as slow,
          pytest.raises(EngineHookError, match=r"no response within 0.5s \(read timeout")):
        list(OpenAICompletions(slow.url, model=model_name, read_timeout=0.5)(
            tokens(300, 2), {**SP, "max_tokens": 1}, ""))
    assert slow.finished == 1
    with (HttpDelayProxy("127.0.0.1", openai_engine.port, delay=3.0, hold="body") as slow,
          pytest.raises(EngineHookError, match=r"reading the stream of POST http://127.0.0.1"
                                               r".* failed: .*\(read timeout 0.5s\)")):
        list(OpenAICompletions(slow.url, model=model_name, read_timeout=0.5)(
            tokens(300, 4), {**SP, "max_tokens": 2}, ""))
    assert slow.finished == 1
    # the same proxy with a patient hook: the held reply arrives whole
    with HttpDelayProxy("127.0.0.1", openai_engine.port, delay=1.0, hold="body") as slow:
        st = OpenAICompletions(slow.url, model=model_name)(tokens(200, 5),
                                                           {**SP, "max_tokens": 2}, "")
        assert len([e.token_id for e in st]) == 2 and st.finish_reason == "length"
    # inside a stream the hook's error is the stream's error, naming the stream
    s = lmc_sdk.request.create_request([], OpenAICompletions(openai_engine.url, model="nope"), [7])
    with pytest.raises(lmc_sdk.request.LMCacheRequestStreamError, match="HTTP 404"):
        s.generate(SP)
    # a good call: tokens as they come, the finish reason and the usage record
    st = ok(tokens(300, 3), {**SP, "max_tokens": 3}, "")
    ids = [e.token_id for e in st]
    assert len(ids) == 3 and st.finish_reason == "length"
    assert st.prompt_tokens == 300 and st.num_cached_tokens is not None


@skip_on_057("the reference is upstream 0.5.6's SDK run in this process, which does not "
             "speak a 0.5.7 server's dialect")
def test_bench_w6_quick(openai_engine, engine_server, model_name):
    """``bench --w6 --quick`` on the shared engine: both sides and the landing probe run, the
    report is complete (no floor: the engine and server were given by URL, their CPU is not
    known to the bench)."""
    from benches.harness.cli import build_parser
    from benches.harness.w6 import run_w6

    args = build_parser().parse_args([
        "--w6", "--quick", "--url", engine_server.url, "--http-url", engine_server.http_url,
        "--w6-vllm-url", openai_engine.url, "--w6-model", model_name, "--w6-streams", "3"])
    doc = run_w6(args)
    assert {r["side"] for r in doc["runs"]} == {"ours", "upstream", "land"}
    land = doc["land"]
    assert 0 <= land["land_first_s"] <= land["land_last_s"] < 60  # every stream's store seen
    assert land["edit_cpu_s"] > 0
    assert "floor" not in doc
    for side in ("ours", "upstream"):
        v = doc["sides"][side]
        assert v["prefill_s"] > 0 and v["modify_s"] > 0 and v["decode_s"] > 0
        assert v["modify_rss_growth"] >= 0 and v["modify_private_growth"] >= 0
        assert v["external_hits"] >= 3 * 256  # the decode read the edited prefixes
    assert set(doc["targets"]) == {"modify_speedup", "modify_rss_ratio",
                                   "modify_private_rss_ratio"}
    # this SDK's side ran the library's drop edit, every stream slot to slot in the
    # engine's element order; the decode read those rows (external hits above)
    assert doc["edit"] == "library" and doc["targets"]["modify_speedup"]["target"] == 15.0
    ours = [r for r in doc["runs"] if r["side"] == "ours"]
    assert ours and all(r["fused_streams"] == 3 for r in ours)
    assert doc["pool"] == "as given (--url)"  # a server given by URL is never emptied
