"""``lmcache_kv_fast.edits`` proven on the real engine (vLLM CPU, tiny Llama, LMCache server).

Part 1 — re-rotation against the engine's own numbers. The engine prefills a prompt (its
connector stores the KV), the SDK retrieves the per-token KV, drops tokens and re-rotates;
the engine then prefills the shortened token list itself (computed: no cached token) and
the SDK retrieves that. Layer 0's K and V depend only on the token and its position, so
they must agree: V bit for bit, K to bf16 rounding; without ``rope=`` K must not. Done for
the default RoPE (the shared engine) and for ``llama3`` and ``yarn`` (the same weights
with only ``config.json`` changed; one engine per class, stopped when the class ends).

Part 2 — the engine decodes from every method's edit: the edited KV stored under the
edited tokens is an external prefix hit of exactly its whole chunks, and the engine's next
token follows that KV (equal, to bf16 rounding, to transformers decoding from the same past
K/V). SnapKV and R-KV are given transformers' queries (this vLLM exports none). Only a
kept prefix is exact for the whole model: its output equals the engine's own cache-free
run; for other edits layer 0 is exact and deeper layers are not, so no equality is claimed.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import lmcache_kv_fast as lkf
from lmcache_kv_fast import edits
from lmcache_kv_fast.testing import LMCacheServer
from testbed.engine import OfflineEngine

from .common import BLOCK, CHUNK, tokens

logger = logging.getLogger(__name__)

TAIL = 16
#: The tiny Llama's RoPE replaced by these (same weights; ``rope_parameters`` of
#: config.json), as in tests/unit/test_edits_rope.py's transformers check.
SCALED_ROPES = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024},
}
#: bf16's unit roundoff (8 significant bits).
U_BF16 = 2.0 ** -8
#: K tolerance per element, relative to the magnitude of its rotary pair. Both sides are
#: bf16 results of the engine's own rotation, so tests/unit/test_edits_rope.py's bf16 bound
#: (2^-7 of |K|max: ONE rounding against an exact float32 reference) does not apply; the
#: measured max here is 3.7e-3 .. 8.4e-3 of |K|max (yarn largest: its mscale 1.14 puts
#: cos/sin above 1, where bf16's step doubles). The bound: per component the engine's K at
#: the new position is off from the exact rotation by <= 3u·r (u = 2^-8, r the pair's
#: magnitude: vLLM's cos/sin cache is bf16, the products and the result are rounded); the
#: edit's K carries the same error from the old position (a pair error of norm <= 3√2·u·r,
#: kept by the exact float32 rotation) plus one rounding (u·r): together < 9u·r.
K_TOL_PAIR = 9 * U_BF16
#: Max |logprob difference| between the bf16 engine and the float32 transformers oracle
#: decoding from the same past K/V (tests/engine/test_engine_kv.py's bound).
LOGPROB_TOL = 0.1
#: The same for an exact edit against the engine's own cache-free run: the loaded K/V are
#: the engine's bits, only the attention's split into cached and computed tokens differs
#: (measured: 0).
EXACT_LOGPROB_TOL = 1e-3


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def external_hits(engine: OfflineEngine) -> float:
    """vLLM's counter of prompt tokens served from LMCache."""
    return max((v for k, v in engine.metrics().items() if "external_prefix_cache_hits" in k),
               default=0.0)


# ---------------------------------------------------------------------- part 1: layer 0
def check_layer0(engine: OfflineEngine, ctx: lkf.LMCacheKVCacheContext, rope: edits.RoPE,
                 prompt: list[int], edit: Callable[..., Any], stale_edit: Callable[..., Any]
                 ) -> dict[str, float]:
    """Edit the engine's KV of ``prompt``; compare layer 0 with the engine's KV of the result.

    Returns the measured errors (relative to layer 0's largest |K|), for the log.
    """
    assert engine.generate([prompt])[0].num_cached_tokens == 0
    kv = ctx.retrieve(prompt)
    assert kv is not None and kv.dtype == torch.bfloat16
    hit = kv.shape[2]
    assert hit == len(prompt) // CHUNK * CHUNK
    out, kept = edit(kv, prompt[:hit])
    stale, kept_stale = stale_edit(kv, prompt[:hit])
    assert kept == kept_stale and len(kept) >= CHUNK
    # the engine computes the shortened token list itself (nothing of it is cached)
    assert engine.generate([kept])[0].num_cached_tokens == 0
    own = ctx.retrieve(kept)
    assert own is not None
    n = len(kept) // CHUNK * CHUNK
    assert own.shape == (2, kv.shape[1], n, kv.shape[3])
    k_ref, k_got, k_stale = own[0, 0].float(), out[0, 0, :n].float(), stale[0, 0, :n].float()
    tol = K_TOL_PAIR * pair_magnitude(k_ref, rope)
    err = float(((k_got - k_ref).abs() / tol).max()) * K_TOL_PAIR
    err_stale = float(((k_stale - k_ref).abs() / tol).max()) * K_TOL_PAIR
    kmax = float(k_ref.abs().max())
    logger.info("layer 0, %s, %d -> %d tokens (%d compared): K error max %.2e of the pair "
                "magnitude, %.2e of |K|max (without rope %.2e of the pair magnitude)",
                rope.rope_type, hit, len(kept), n, err,
                float((k_got - k_ref).abs().max()) / kmax, err_stale)
    assert torch.equal(bits(out[1, 0, :n]), bits(own[1, 0])), "V of layer 0 is not bit-exact"
    assert err <= K_TOL_PAIR, f"K is {err:.2e} of its pair magnitude off (> {K_TOL_PAIR:.2e})"
    # negative control: the same selection without re-rotation is far off
    assert err_stale > 10 * K_TOL_PAIR, f"without rope= K is only {err_stale:.2e} off"
    # V needs no re-rotation: the same with or without rope
    assert torch.equal(bits(stale[1]), bits(out[1]))
    return {"k": err, "k_stale": err_stale}


def pair_magnitude(k: torch.Tensor, rope: edits.RoPE) -> torch.Tensor:
    """Per element of ``k`` ``[T, H*Dh]``: the magnitude of its rotary (neox) pair, floored
    at the smallest normal bf16 (so the tolerance is never 0)."""
    kh = k.unflatten(-1, (-1, rope.head_dim))
    half = rope.rotary_dim // 2
    assert not rope.interleaved and rope.rotary_dim == rope.head_dim
    r = kh[..., :half].hypot(kh[..., half:])
    return torch.cat([r, r], dim=-1).flatten(-2).clamp_min(torch.finfo(torch.bfloat16).tiny)


def irregular_indices(count: int, keep: int, seed: int) -> list[int]:
    """``keep`` sorted distinct indices of ``count``: runs, gaps and single holes mixed."""
    rng = random.Random(seed)
    chosen = set(range(0, 40)) | set(range(count - 60, count))  # a head and a tail run
    while len(chosen) < keep:
        chosen.add(rng.randrange(count))
    return sorted(chosen)[:keep] if len(chosen) > keep else sorted(chosen)


def drop_case(engine: OfflineEngine, ctx: lkf.LMCacheKVCacheContext, rope: edits.RoPE,
              seed: int) -> dict[str, float]:
    """``drop_every(4)`` of a 3-chunk prompt: 576 tokens kept, 512 compared."""
    prompt = tokens(3 * CHUNK + TAIL, seed)
    return check_layer0(engine, ctx, rope, prompt, edits.drop_every(4, rope=rope),
                        edits.drop_every(4))


def keep_case(engine: OfflineEngine, ctx: lkf.LMCacheKVCacheContext, rope: edits.RoPE,
              seed: int) -> dict[str, float]:
    """``keep`` of an irregular index set: 600 of 768 tokens, 512 compared."""
    prompt = tokens(3 * CHUNK + TAIL, seed)
    idx = irregular_indices(3 * CHUNK, 600, seed)
    return check_layer0(engine, ctx, rope, prompt, edits.keep(idx, rope=rope), edits.keep(idx))


def test_default_rope_drop_every_layer0(offline_engine, sdk, tiny_model):
    rope = edits.rope_from_config(tiny_model)
    assert rope.rope_type == "default"
    drop_case(offline_engine, sdk, rope, seed=3501)


def test_default_rope_keep_irregular_layer0(offline_engine, sdk, tiny_model):
    keep_case(offline_engine, sdk, edits.rope_from_config(tiny_model), seed=3502)


# ---------------------------------------------------------------------- part 2: decode
@dataclass
class Source:
    """The engine's KV of one 4-chunk prompt, its last window's queries, the model's RoPE."""

    prompt: list[int]
    kv: torch.Tensor
    queries: torch.Tensor
    rope: edits.RoPE


#: Observation window of SnapKV (R-KV uses the last 8 of these queries).
WINDOW = 32


@pytest.fixture(scope="module")
def source(offline_engine, sdk, oracle, tiny_model) -> Source:
    """The engine prefills a prompt; the SDK retrieves its 1024 stored tokens' KV.

    The queries SnapKV / R-KV are given (``queries=``, the caller's form) are transformers'
    post-RoPE query states of the prompt's last :data:`WINDOW` positions on the same
    weights: this vLLM exports no queries.
    """
    prompt = tokens(4 * CHUNK + TAIL, 3510)
    assert offline_engine.generate([prompt])[0].num_cached_tokens == 0
    kv = sdk.retrieve(prompt)
    assert kv is not None and kv.shape[2] == 4 * CHUNK
    q, _att = oracle.window_attention(prompt[: 4 * CHUNK], WINDOW)  # [L, Hq, W, Dh]
    queries = q.permute(0, 2, 1, 3).reshape(q.shape[0], WINDOW, -1)  # [L, W, Hq*Dh]
    return Source(prompt[: 4 * CHUNK], kv, queries, edits.rope_from_config(tiny_model))


def method_edit(name: str, src: Source) -> Callable[..., Any]:
    """The edit of ``name`` with ``rope=`` (every one re-rotates to ``0 .. T'-1``)."""
    rope, q = src.rope, src.queries
    return {
        "drop_every": lambda: edits.drop_every(4, rope=rope),
        "keep_ratio": lambda: edits.keep_ratio(0.5, rope=rope),
        "keep_budget": lambda: edits.keep_budget(600, score="l2", sinks=4, rope=rope),
        "streaming_llm": lambda: edits.streaming_llm(4, 600, rope=rope),
        "key_norm": lambda: edits.key_norm(ratio=0.6, method="l2", rope=rope),
        "rkv": lambda: edits.rkv(q, budget=520, rope=rope),
        "snapkv": lambda: edits.snapkv(q, window=WINDOW, ratio=0.55, rope=rope),
        "chain": lambda: edits.chain(edits.drop_every(10, rope=rope),
                                     edits.key_norm(ratio=0.8, rope=rope)),
        # exact: a kept prefix is what the engine computes for it (causal attention)
        "prefix": lambda: edits.streaming_llm(2 * CHUNK + 40, 0, rope=rope),
    }[name]()


def store_edit(ctx: lkf.LMCacheKVCacheContext, src: Source, edit: Callable[..., Any]
               ) -> tuple[torch.Tensor, list[int], int]:
    """Edit the source KV, store it under the edited tokens; (kv, tokens, stored length)."""
    kv, kept = edit(src.kv, src.prompt)
    assert kv.shape[2] == len(kept) and kv.dtype == torch.bfloat16
    expected = len(kept) // CHUNK * CHUNK
    res = ctx.store_ex(kv, kept)
    assert res.ok and res.tokens_stored == expected, res
    assert ctx.lookup(kept) == expected
    return kv, kept, expected


METHODS = ["drop_every", "keep_ratio", "keep_budget", "streaming_llm", "key_norm", "rkv",
           "snapkv", "chain"]


@pytest.mark.parametrize("method", METHODS)
def test_engine_decodes_from_the_edit(offline_engine, sdk, oracle, source, method):
    kv, kept, expected = store_edit(sdk, source, method_edit(method, source))
    assert expected >= 2 * CHUNK
    suffix = tokens(TAIL, 3520)
    assert offline_engine.reset_prefix_cache()  # hits can only come from LMCache
    before = external_hits(offline_engine)
    got = offline_engine.generate([kept + suffix], logprobs=1024)[0]
    assert got.num_cached_tokens == expected
    assert external_hits(offline_engine) - before == expected
    # the engine's next token follows the stored edit: transformers decoding the rest at
    # positions expected.. from the same past K/V gives the same distribution
    ref = oracle.next_logprobs(kept[expected:] + suffix, past_kv=kv[:, :, :expected].float(),
                               start_pos=expected)
    diff = float((got.logprobs[0] - ref).abs().max())
    logger.info("%s: kept %d, hit %d, |logprob - oracle(edit)| %.3f", method, len(kept),
                got.num_cached_tokens, diff)
    assert diff < LOGPROB_TOL
    top2 = ref.topk(2).values
    if float(top2[0] - top2[1]) > 2 * LOGPROB_TOL:  # a clear winner: the same greedy token
        assert got.token_ids[0] == int(ref.argmax())


def test_exact_edit_decodes_like_a_cache_free_run(offline_engine, sdk, source):
    """A kept prefix is exact: greedy output equals the engine's own run without cache."""
    kv, kept, expected = store_edit(sdk, source, method_edit("prefix", source))
    suffix = tokens(TAIL, 3521)
    assert offline_engine.reset_prefix_cache()
    got = offline_engine.generate([kept + suffix], max_tokens=8, logprobs=1024)[0]
    fresh = offline_engine.generate([kept + suffix], max_tokens=8, logprobs=1024,
                                    cache_salt="edits-cache-free")[0]
    assert got.num_cached_tokens == expected and fresh.num_cached_tokens == 0
    assert got.token_ids == fresh.token_ids
    diff = float((got.logprobs - fresh.logprobs).abs().max())
    logger.info("prefix edit: |logprob(loaded) - logprob(computed)| %.2e", diff)
    assert diff <= EXACT_LOGPROB_TOL
    # and the stored K/V are the engine's own for those tokens (re-rotation by 0: a no-op)
    own = sdk.retrieve(kept + suffix, cache_salt="edits-cache-free")
    assert own is not None and own.shape[2] == expected
    assert torch.equal(bits(own), bits(kv[:, :, :expected]))


def test_drop_every_rope_brings_decode_towards_the_shortened_prompt(offline_engine, sdk,
                                                                    source):
    """drop_every with rope= is not exact beyond layer 0, so equality is not asserted; the
    engine's cache-free run of the shortened list is closer to the re-rotated edit's output
    than to the stale (not re-rotated) edit's."""
    suffix = tokens(TAIL, 3522)
    _kv, kept, expected = store_edit(sdk, source, edits.drop_every(4, rope=source.rope))
    stale, kept_stale = edits.drop_every(4)(source.kv, source.prompt)
    assert kept_stale == kept
    assert sdk.store(stale, kept, cache_salt="edits-stale")  # same tokens: its own salt
    outs = {}
    for name, salt in (("rope", None), ("stale", "edits-stale")):
        assert offline_engine.reset_prefix_cache()
        outs[name] = offline_engine.generate([kept + suffix], logprobs=1024,
                                             cache_salt=salt)[0]
        assert outs[name].num_cached_tokens == expected
    fresh = offline_engine.generate([kept + suffix], logprobs=1024,
                                    cache_salt="edits-drop-cache-free")[0]
    assert fresh.num_cached_tokens == 0
    d_rope = float((outs["rope"].logprobs[0] - fresh.logprobs[0]).abs().max())
    d_stale = float((outs["stale"].logprobs[0] - fresh.logprobs[0]).abs().max())
    logger.info("drop_every(4): |logprob - cache-free| with rope %.3f, stale %.3f",
                d_rope, d_stale)
    assert d_rope < d_stale


# ---------------------------------------------------------------------- part 1: scaled RoPE
@dataclass
class ScaledEngine:
    """An engine on the tiny weights with another RoPE, and the SDK on its model."""

    model: Path
    rope: edits.RoPE
    engine: OfflineEngine
    ctx: lkf.LMCacheKVCacheContext


def model_with_rope(src: Path, dst: Path, rope_parameters: dict[str, Any]) -> Path:
    """``src``'s files linked into ``dst``, ``rope_parameters`` set in its config.json."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg["rope_parameters"] = rope_parameters
    (dst / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return dst


@pytest.fixture(scope="class")
def scaled(request: pytest.FixtureRequest, tiny_model: Path, engine_server: LMCacheServer,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScaledEngine]:
    """An engine on the class's RoPE variant; stopped when the class's tests are done."""
    variant = request.cls.VARIANT
    model = model_with_rope(tiny_model, tmp_path_factory.mktemp("rope") / variant,
                            SCALED_ROPES[variant])
    rope = edits.rope_from_config(model)
    assert rope.rope_type == variant
    with OfflineEngine(model, engine_server.port, block_size=BLOCK) as engine:
        ctx = lkf.connect(engine_server.url, engine_server.http_url, str(model), timeout=60)
        try:
            yield ScaledEngine(model, rope, engine, ctx)
        finally:
            ctx.close()


class _ScaledRoPE:
    """Part 1 on an engine whose config.json names another RoPE (same weights)."""

    VARIANT = ""
    SEED = 0

    def test_drop_every_layer0(self, scaled: ScaledEngine) -> None:
        drop_case(scaled.engine, scaled.ctx, scaled.rope, seed=self.SEED)

    def test_keep_irregular_layer0(self, scaled: ScaledEngine) -> None:
        keep_case(scaled.engine, scaled.ctx, scaled.rope, seed=self.SEED + 1)


class TestLlama3RoPE(_ScaledRoPE):
    VARIANT = "llama3"
    SEED = 3530


class TestYarnRoPE(_ScaledRoPE):
    VARIANT = "yarn"
    SEED = 3540
