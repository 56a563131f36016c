"""The SDK against a real vLLM CPU engine, the real LMCache server and a transformers oracle.

The SDK connects as a user does, with the model name only (the ``sdk`` fixture): it finds
the CPU engine's geometry itself, ``retrieve`` hands out per-token K/V and ``store`` writes
the engine's order back. ``raw=True`` reads the engine's rows bit-exact. Tests run in file
order and share one engine; each uses its own prompts.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_kv_fast.layout import CpuEngineKV, raw_rows_from_paged_blocks, resolve_engine_layout
from testbed.engine import OpenAIEngine

from .common import BLOCK, CHUNK, tokens, unregister_engine_driven

TAIL = 16
#: Max |logprob difference| allowed between the bf16 engine and the float32 oracle; the
#: tests also show that the wrong references are several times further away.
LOGPROB_TOL = 0.1


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


# ---------------------------------------------------------------------- registration
def test_engine_registration_and_geometry(offline_engine, engine_server, model_name, cpu_kv, sdk):
    assert offline_engine.isa == [cpu_kv.kernel] * cpu_kv.num_layers
    nb = offline_engine.info["kv_shape"][0][0]
    assert offline_engine.info["kv_shape"] == [[nb, 2, BLOCK, 2 * 64]] * 2
    assert offline_engine.info["kv_dtype"] == ["torch.bfloat16"] * 2
    st = engine_server.status()
    assert st["cache_context_meta"] == {}
    mine = {k: v for k, v in st["non_cuda_context_meta"].items() if v["model_name"] == model_name}
    # the engine(s) and SDK contexts (this one: a reader and a writer registration; others
    # of the shared server, e.g. upstream's, which never unregisters): the same four
    # fields, nothing else published
    own = {str(sdk.instance_id), str(sdk.writer_instance_id)}
    assert own <= set(mine) and len(mine) >= 3
    for entry in mine.values():
        assert entry == {"model_name": model_name, "world_size": 1, "block_size": BLOCK,
                         "use_mla": True}
    res = resolve_engine_layout(st, model_name,
                                exclude_instance_ids=[sdk.instance_id, sdk.writer_instance_id])
    assert res.cpu == cpu_kv and res.layout == cpu_kv.raw_layout
    assert res.instance_ids == tuple(k for k in mine if k not in own)
    # what plain connect() found
    assert sdk.engine_kv == cpu_kv
    assert sdk.layout == cpu_kv.token_layout and sdk.raw_layout == cpu_kv.raw_layout
    assert sdk.kv_shape(CHUNK) == (2, 2, CHUNK, 128)
    assert sdk.kv_shape(CHUNK, raw=True) == (2, CHUNK, 256)


# ---------------------------------------------------------------------- prefill / raw / per-token
def test_prefill_lookup_whole_chunks(offline_engine, sdk):
    a, b = tokens(2 * CHUNK + TAIL, 1), tokens(CHUNK + 44, 2)
    assert sdk.lookup(a) == 0 and sdk.lookup(b) == 0
    gens = offline_engine.generate([a, b])
    assert [g.num_cached_tokens for g in gens] == [0, 0]
    assert sdk.lookup(a) == 2 * CHUNK
    assert sdk.lookup(b) == CHUNK


@pytest.fixture(scope="module")
def prefilled(offline_engine, sdk):
    """A 528-token prompt computed by the engine: (tokens, generation, raw rows, per-token K/V)."""
    a = tokens(2 * CHUNK + TAIL, 3)
    gen = offline_engine.generate([a])[0]
    raw = sdk.retrieve(a, raw=True)
    kv = sdk.retrieve(a)
    assert raw is not None and kv is not None
    return a, gen, raw, kv


def test_retrieve_raw_equals_engine_paged_blocks(offline_engine, prefilled, cpu_kv):
    a, gen, raw, _kv = prefilled
    assert raw.shape == (cpu_kv.num_layers, 2 * CHUNK, cpu_kv.num_kv_heads * 2 * cpu_kv.head_dim)
    blocks = offline_engine.block_ids(gen.request_id)
    assert len(blocks) == -(-len(a) // BLOCK)
    engine_rows = raw_rows_from_paged_blocks(offline_engine.read_blocks(blocks))
    assert torch.equal(bits(raw), bits(engine_rows[:, : 2 * CHUNK]))


def test_per_token_kv_equals_transformers(prefilled, cpu_kv, oracle, sdk):
    a, _gen, raw, kv = prefilled
    assert torch.equal(bits(kv), bits(cpu_kv.to_tokens(raw)))  # retrieve converted exactly
    out = torch.full((2, 2, 3 * CHUNK, 128), 7.0, dtype=torch.bfloat16)
    got = sdk.retrieve(a, out=out)  # into a caller's buffer: the first hit tokens
    assert got is not None and got.data_ptr() == out.data_ptr()
    assert torch.equal(bits(got), bits(kv)) and bool((out[:, :, 2 * CHUNK:] == 7).all())
    ref = oracle.kv(a)[:, :, : 2 * CHUNK]
    assert kv.shape == ref.shape == (2, 2, 2 * CHUNK, 128)
    for plane in (0, 1):
        for layer in range(2):
            assert rel_err(kv[plane, layer], ref[plane, layer]) < 0.02, (plane, layer)
    # the raw rows read as tokens, or with another kernel's order, are nowhere near
    naive = raw.view(2, 2 * CHUNK, 2, 2, 64).permute(2, 0, 1, 3, 4).reshape(ref.shape)
    assert rel_err(naive, ref) > 0.5
    other = "amx" if cpu_kv.kernel != "amx" else "vec"
    wrong = CpuEngineKV(2, 2, 64, torch.bfloat16, BLOCK, other).to_tokens(raw)
    assert rel_err(wrong, ref) > 0.5
    assert torch.equal(bits(cpu_kv.to_raw(kv)), bits(raw))


# ---------------------------------------------------------------------- transplant A -> B
@pytest.fixture(scope="module")
def reference_a(offline_engine):
    """Prompt A + tail run twice; the second run reads A's 512 tokens from cache."""
    a, tail = tokens(2 * CHUNK, 10), tokens(TAIL, 11)
    first = offline_engine.generate([a + tail], logprobs=1024)[0]
    second = offline_engine.generate([a + tail], logprobs=1024)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 2 * CHUNK
    return a, tail, second


def test_transplant_kv_of_a_under_prefix_b(offline_engine, sdk, reference_a):
    a, tail, ref = reference_a
    b = tokens(2 * CHUNK, 12)
    kv_a = sdk.retrieve(a)  # per-token, stored back per-token: the engine's order restored
    assert kv_a is not None and kv_a.shape == (2, 2, 2 * CHUNK, 128)
    assert sdk.store(kv_a, b)
    assert torch.equal(bits(sdk.retrieve(b, raw=True)), bits(sdk.retrieve(a, raw=True)))
    before = offline_engine.metrics()
    got = offline_engine.generate([b + tail], logprobs=1024)[0]
    assert got.num_cached_tokens == 2 * CHUNK  # served from LMCache: B was never computed
    after = offline_engine.metrics()
    hits = [k for k in after if "external_prefix_cache_hits" in k]
    assert hits and all(after[k] - before.get(k, 0) == 2 * CHUNK for k in hits), after
    assert got.token_ids == ref.token_ids
    assert torch.equal(got.logprobs, ref.logprobs)
    # control: a prefix nobody stored gives another distribution
    c = offline_engine.generate([tokens(2 * CHUNK, 13) + tail], logprobs=1024)[0]
    assert c.num_cached_tokens == 0
    assert (c.logprobs - ref.logprobs).abs().max() > 5 * LOGPROB_TOL


# ---------------------------------------------------------------------- token dropping
@pytest.fixture(scope="module")
def dropped(offline_engine, sdk, cpu_kv):
    """Prefill 800 tokens, drop every 10th token's K/V, store under the new token list.

    The user path: per-token retrieve, edit, per-token store of the whole edit (the store
    keeps its whole chunks). Returns (new token list, edited per-token K/V of the stored
    512 tokens, the engine rows the SDK stored).
    """
    prompt = tokens(800, 20)
    assert offline_engine.generate([prompt])[0].num_cached_tokens == 0
    kv = sdk.retrieve(prompt)
    assert kv is not None and kv.shape == (2, 2, 3 * CHUNK, 128)
    keep = [i for i in range(kv.shape[2]) if i % 10 != 9]
    edited_all = kv[:, :, keep]  # 692 tokens: 2 whole chunks + a partial one
    new_tokens = [t for i, t in enumerate(prompt) if i % 10 != 9]
    res = sdk.store_ex(edited_all, new_tokens[: len(keep)])
    assert res.ok and res.tokens_stored == 2 * CHUNK
    edited = edited_all[:, :, : 2 * CHUNK].contiguous()
    stored = sdk.retrieve(new_tokens, raw=True)
    assert stored is not None and torch.equal(bits(stored), bits(cpu_kv.to_raw(edited)))
    assert torch.equal(bits(sdk.retrieve(new_tokens)), bits(edited))
    return new_tokens, edited, stored


def test_token_dropping_matches_transformers_oracle(offline_engine, oracle, dropped):
    new_tokens, edited, _stored = dropped
    assert len(new_tokens) == 720
    got = offline_engine.generate([new_tokens], logprobs=1024)[0]
    assert got.num_cached_tokens == 2 * CHUNK  # the edited KV, an external hit
    # vLLM computes tokens 512..719 at positions 512..719 on top of the edited KV (whose K
    # keep the rotation of their original positions); the oracle does the same.
    ref = oracle.next_logprobs(new_tokens[2 * CHUNK:], past_kv=edited.float(),
                               start_pos=2 * CHUNK)
    diff = float((got.logprobs[0] - ref).abs().max())
    assert diff < LOGPROB_TOL
    assert got.token_ids[0] == int(ref.argmax())
    # a plain prefill of the new token list is a different computation
    # (measured here: 0.023 from the oracle, 0.89 from a plain prefill of the new list)
    plain = oracle.next_logprobs(new_tokens)
    assert float((got.logprobs[0] - plain).abs().max()) > 3 * LOGPROB_TOL


# ---------------------------------------------------------------------- salt / misses
def test_cache_salt_isolates(offline_engine, sdk):
    s = tokens(2 * CHUNK + TAIL, 30)
    assert offline_engine.generate([s], cache_salt="salt-a")[0].num_cached_tokens == 0
    assert sdk.lookup(s) == 0
    assert sdk.lookup(s, cache_salt="salt-a") == 2 * CHUNK
    assert offline_engine.reset_prefix_cache()
    assert offline_engine.generate([s], cache_salt="salt-b")[0].num_cached_tokens == 0
    assert offline_engine.reset_prefix_cache()
    assert offline_engine.generate([s], cache_salt="salt-a")[0].num_cached_tokens == 2 * CHUNK
    # and an SDK store under a salt is seen only with that salt
    t = tokens(2 * CHUNK + TAIL, 31)
    kv = sdk.retrieve(s, cache_salt="salt-a")
    assert kv is not None and kv.shape == (2, 2, 2 * CHUNK, 128)
    assert sdk.store(kv, t[: 2 * CHUNK], cache_salt="salt-c")
    assert offline_engine.generate([t])[0].num_cached_tokens == 0
    assert offline_engine.reset_prefix_cache()
    assert offline_engine.generate([t], cache_salt="salt-c")[0].num_cached_tokens == 2 * CHUNK


def test_never_stored_prompt_misses(offline_engine, sdk):
    n = tokens(2 * CHUNK + TAIL, 40)
    assert sdk.lookup(n) == 0
    assert sdk.retrieve(n) is None and sdk.retrieve(n, raw=True) is None
    assert offline_engine.generate([n])[0].num_cached_tokens == 0


# ---------------------------------------------------------------------- a fresh engine
def test_fresh_engine_process_serves_sdk_stored_kv(tiny_model, engine_server, sdk,
                                                    reference_a):
    a, tail, ref = reference_a
    d = tokens(2 * CHUNK, 50)
    assert sdk.store(sdk.retrieve(a), d)
    with OpenAIEngine(tiny_model, engine_server.port, block_size=BLOCK) as fresh:
        got = fresh.complete(d + tail, logprobs=1024)
        never = fresh.complete(tokens(2 * CHUNK + TAIL, 51))
        rpc = fresh.rpc_dir
        assert rpc is not None and any(p.is_socket() for p in rpc.iterdir())
    assert not rpc.exists()  # vLLM's IPC sockets went with the engine, not left in /tmp
    assert got.num_cached_tokens == 2 * CHUNK
    assert got.token_ids == ref.token_ids
    assert float((got.logprobs[0] - ref.logprobs[0]).abs().max()) < 1e-3
    assert never.num_cached_tokens == 0


# ---------------------------------------------------------------------- upstream SDK
def test_upstream_sdk_reads_the_edit_bit_exact(engine_server, model_name, dropped, cpu_kv):
    import lmcache.sdk.kvcache as upstream

    from lmcache_kv_fast.testing import register_vllm_layout

    if not engine_server.http().version().startswith("0.5.6"):
        pytest.skip("runs this venv's upstream 0.5.6 SDK in-process, which does not speak a "
                    "0.5.7 server's dialect; 0.5.7rc2's own SDK reads ours in "
                    "tests/compat (ours->theirs rows)")
    new_tokens, _edited, stored = dropped
    # upstream 0.5.6 finds no layout for an engine-driven registration: supply it the way
    # it reads one (a vLLM registration whose single-plane object is the engine's rows)
    raw = cpu_kv.raw_layout
    reg = register_vllm_layout(engine_server.url, model_name, num_layers=raw.num_layers,
                               num_kv_heads=1, head_size=raw.head_dim, dtype=raw.dtype_str,
                               block_size=BLOCK, layout="MLA")
    try:
        theirs = upstream.connect(engine_server.url, engine_server.http_url, model_name,
                                  timeout=60)
        try:
            got = theirs.retrieve(new_tokens[: 2 * CHUNK])
        finally:
            theirs.close()
            unregister_engine_driven(engine_server.url, theirs.instance_id)
    finally:
        reg.unregister()
    assert got is not None
    assert torch.equal(bits(got.reshape(stored.shape)), bits(stored))


# ---------------------------------------------------------------------- the driver itself
def test_driver_reports_errors_and_keeps_serving(offline_engine):
    from testbed.engine_proc import EngineChildError

    with pytest.raises(EngineChildError, match="unknown op 'nope'"):
        offline_engine._child.call("nope")
    with pytest.raises(EngineChildError, match="no-such-request"):
        offline_engine.block_ids("no-such-request")
    assert offline_engine.generate([tokens(40, 60)])[0].num_cached_tokens == 0
