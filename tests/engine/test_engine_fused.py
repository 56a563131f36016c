"""The fused rewrite on the real engine: a library edit's rows moved slot to slot in the CPU
engine's own element order, then reused by the engine.

The engine prefills a prompt (its connector stores the raw rows); ``batch.rewrite`` with
``edits.drop_every(4, rope=)`` takes the fused path (``fused_blocks``: no per-token
tensor). What it stored must be the unfused edit's KV bit for bit (the same rotation
code), layer 0 must agree with what the engine computes for the shortened token list
(V bit for bit, K to bf16 rounding: tests/engine/test_engine_edits.py's bound), and the
engine must decode from it with an external prefix hit of its whole chunks, exactly as
from the unfused edit stored under another salt.
"""

from __future__ import annotations

import logging

import torch

import lmcache_kv_fast as lkf
from lmcache_kv_fast import batch, edits
from testbed.engine import OfflineEngine

from .common import CHUNK, tokens
from .test_engine_edits import K_TOL_PAIR, bits, external_hits, pair_magnitude

logger = logging.getLogger(__name__)

TAIL = 16


def test_fused_rewrite_is_the_edit_and_the_engine_reuses_it(offline_engine: OfflineEngine,
                                                            sdk: lkf.LMCacheKVCacheContext,
                                                            tiny_model):
    assert sdk.rewrites_rows, "a CPU engine's rows should be rewritten slot to slot"
    rope = edits.rope_from_config(tiny_model)
    edit = edits.drop_every(4, rope=rope)
    prompt = tokens(4 * CHUNK + TAIL, 3601)
    assert offline_engine.generate([prompt])[0].num_cached_tokens == 0
    kv = sdk.retrieve(prompt)
    assert kv is not None and kv.shape[2] == 4 * CHUNK
    want, kept = edit(kv, prompt[: 4 * CHUNK])  # the unfused edit
    n = len(kept) // CHUNK * CHUNK
    assert n == 3 * CHUNK

    rep = batch.rewrite(sdk, [prompt], edit, progress=False)
    assert rep.path == "fused" and rep.fused == 1 and not rep.failed, rep.summary()
    got = sdk.retrieve(kept)
    assert got is not None and got.shape[2] == n
    assert torch.equal(bits(got), bits(want[:, :, :n])), "fused bytes != the unfused edit's"
    # the raw rows too: what the engine loads is the unfused edit converted to its order
    assert sdk.store(want, kept, cache_salt="unfused")
    raw_f = sdk.retrieve(kept, raw=True)
    raw_t = sdk.retrieve(kept, cache_salt="unfused", raw=True)
    assert raw_f is not None and raw_t is not None and torch.equal(bits(raw_f), bits(raw_t))

    # layer 0 against the engine's own computation of the shortened list
    assert offline_engine.generate([kept], cache_salt="fused-fresh")[0].num_cached_tokens == 0
    own = sdk.retrieve(kept, cache_salt="fused-fresh")
    assert own is not None and own.shape[2] == n
    assert torch.equal(bits(got[1, 0]), bits(own[1, 0])), "V of layer 0 is not bit-exact"
    k_ref, k_got = own[0, 0].float(), got[0, 0].float()
    err = float(((k_got - k_ref).abs() / (K_TOL_PAIR * pair_magnitude(k_ref, rope))).max())
    logger.info("fused drop_every(4, rope): layer-0 K error %.2e of the bound", err)
    assert err <= 1.0

    # the engine decodes from the fused edit as from the unfused one
    suffix = tokens(TAIL, 3602)
    outs = {}
    for name, salt in (("fused", None), ("unfused", "unfused")):
        assert offline_engine.reset_prefix_cache()  # hits can only come from LMCache
        before = external_hits(offline_engine)
        outs[name] = offline_engine.generate([kept + suffix], max_tokens=4, logprobs=1024,
                                             cache_salt=salt)[0]
        assert outs[name].num_cached_tokens == n
        assert external_hits(offline_engine) - before == n
    assert outs["fused"].token_ids == outs["unfused"].token_ids
    assert torch.equal(outs["fused"].logprobs, outs["unfused"].logprobs)
