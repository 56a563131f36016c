"""Selection edits on small hand-made KV: each keeps what it says, in token order (fast tier).

No server, no engine: the cases are built so the right answer is known (a low-norm key, a
key unlike the others, a token the observation window attends to, duplicated keys), and
SnapKV is also compared with a plain per-head reference written here with GQA spelled out.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmcache_kv_fast import edits
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind

DH = 8
ROPE = edits.rope_from_config({"model_type": "llama", "hidden_size": 32,
                               "num_attention_heads": 4, "head_dim": DH, "rope_theta": 1e4})


def _kv(layers: int = 2, count: int = 10, heads: int = 2, seed: int = 0,
        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, count, heads * DH, generator=gen).to(dtype)


def _tokens(count: int) -> list[int]:
    return list(range(100, 100 + count))


def _kept(edit, kv: torch.Tensor, tokens: list[int]) -> list[int]:
    """Indices the edit kept (tokens are 100 + index); checks the KV rows match them."""
    out, new_tokens = edit(kv, tokens)
    idx = [t - 100 for t in new_tokens]
    assert idx == sorted(idx), "token order not kept"
    if getattr(edit, "rope", None) is None:
        assert torch.equal(out, kv[:, :, idx])
    return idx


# ------------------------------------------------------------------ by position
def test_keep_sorts_and_gathers() -> None:
    """keep(indices) keeps those rows, in token order, bit-exact without rope."""
    assert _kept(edits.keep([4, 1, 2]), _kv(), _tokens(10)) == [1, 2, 4]


def test_drop_every_and_streaming_llm() -> None:
    """drop_every(3) drops 2, 5, 8; streaming_llm(2, 3) keeps 0, 1 and the last 3."""
    kv, tok = _kv(), _tokens(10)
    assert _kept(edits.drop_every(3), kv, tok) == [0, 1, 3, 4, 6, 7, 9]
    assert _kept(edits.streaming_llm(2, 3), kv, tok) == [0, 1, 7, 8, 9]
    assert _kept(edits.streaming_llm(6, 6), kv, tok) == list(range(10))


def test_tokens_as_tensor_and_bf16() -> None:
    """A token tensor comes back a tensor; bf16 KV is gathered bit-exact."""
    kv = _kv(dtype=torch.bfloat16)
    out, tok = edits.drop_every(2)(kv, torch.arange(10))
    assert isinstance(tok, torch.Tensor) and tok.tolist() == [0, 2, 4, 6, 8]
    assert out.dtype == torch.bfloat16 and torch.equal(out, kv[:, :, ::2])


def test_token_lists_come_back_as_python_ints() -> None:
    """A list or tuple of tokens (numpy integers too) comes back a list of exact ints."""
    import numpy as np

    kv = _kv()
    for toks in ([5, 6, 7, 8], (5, 6, 7, 8), [np.int64(t) for t in (5, 6, 7, 8)]):
        _, tok = edits.drop_every(2)(kv[:, :, :4], toks)
        assert tok == [5, 7] and all(type(t) is int for t in tok)


# ------------------------------------------------------------------ key scores
def _keys_with(rows: list[torch.Tensor], heads: int = 2) -> torch.Tensor:
    """KV [2, 1, T, heads*DH] whose K row t is ``rows[t]`` in every head; V random."""
    k = torch.stack(rows)[:, None, :].expand(-1, heads, -1).reshape(1, len(rows), heads * DH)
    return torch.stack([k, torch.randn_like(k)])


def test_key_norm_l2_keeps_low_norm_keys() -> None:
    """method='l2' keeps the lowest-norm keys (Devoto et al. 2024)."""
    e = torch.ones(DH) / math.sqrt(DH)
    kv = _keys_with([e * n for n in (5, 1, 5, 2, 5, 3)])
    assert _kept(edits.key_norm(budget=3, method="l2", head_dim=DH), kv, _tokens(6)) == [1, 3, 5]


def test_key_norm_keydiff_keeps_distinct_keys() -> None:
    """KeyDiff keeps the keys least similar to the mean key (Park et al. 2025)."""
    e0, e1 = torch.eye(DH)[0], torch.eye(DH)[1]
    rows = [e0 * (1 + 0.1 * i) for i in range(8)]
    rows[2], rows[5] = e1, -e0 + e1
    kv = _keys_with(rows)
    assert _kept(edits.key_norm(budget=2, head_dim=DH), kv, _tokens(8)) == [2, 5]
    assert _kept(edits.keep_budget(3, "keydiff", sinks=1, head_dim=DH), kv, _tokens(8)) == \
        [0, 2, 5]


def test_keep_ratio_uniform_random_callable() -> None:
    """Ratio rounds up; uniform is evenly spaced; random is seeded; a callable scores."""
    kv, tok = _kv(), _tokens(10)
    assert _kept(edits.keep_ratio(0.5, "uniform"), kv, tok) == [0, 2, 4, 6, 8]
    assert len(_kept(edits.keep_ratio(0.25, "uniform"), kv, tok)) == 3
    assert _kept(edits.keep_budget(4, "uniform", sinks=1, recent=1), kv, tok) == [0, 1, 5, 9]
    a = _kept(edits.keep_ratio(0.5, "random", seed=3), kv, tok)
    assert a == _kept(edits.keep_ratio(0.5, "random", seed=3), kv, tok) and len(a) == 5
    by_index = edits.keep_budget(3, lambda kv, t: torch.arange(kv.shape[2]).float())
    assert _kept(by_index, kv, tok) == [7, 8, 9]


def test_aggregate_mean_versus_max() -> None:
    """Per-(layer, head) scores: mean and max over heads pick different tokens."""
    s = torch.tensor([[[9.0, 0, 0], [0, 5, 4], [0, 5, 4]]])  # [L=1, H=3, T=3]
    kv = _kv(layers=1, count=3)
    assert _kept(edits.keep_budget(1, lambda kv, t: s, aggregate="mean"), kv, _tokens(3)) == [1]
    assert _kept(edits.keep_budget(1, lambda kv, t: s, aggregate="max"), kv, _tokens(3)) == [0]


# ------------------------------------------------------------------ SnapKV
def _gqa_case() -> tuple[torch.Tensor, torch.Tensor]:
    """KV with Hkv=2 and queries with Hq=4 (g=2) where the right grouping matters.

    Query heads 0, 1 (KV head 0) look along u, heads 2, 3 (KV head 1) along v. KV head 0
    holds u at token 3 and v at token 9; KV head 1 holds v at token 7 and u at token 5.
    With h -> h // g the window attends to 3 and 7; a wrong grouping would spread it over
    3, 5, 7, 9.
    """
    count, hkv, hq = 12, 2, 4
    u, v = torch.eye(DH)[0] * 4, torch.eye(DH)[1] * 4
    k = torch.randn(1, count, hkv, DH, generator=torch.Generator().manual_seed(1)) * 0.05
    k[0, 3, 0], k[0, 9, 0], k[0, 7, 1], k[0, 5, 1] = u, v, v, u
    kv = torch.stack([k.reshape(1, count, hkv * DH), torch.randn(1, count, hkv * DH)])
    q = torch.zeros(1, count, hq, DH)
    q[0, :, 0], q[0, :, 1], q[0, :, 2], q[0, :, 3] = u, u, v, v
    return kv, q.reshape(1, count, hq * DH)


def test_snapkv_gqa_keeps_what_the_window_attends_to() -> None:
    """SnapKV keeps the window and the tokens its query groups attend to most."""
    kv, q = _gqa_case()
    edit = edits.snapkv(q, window=2, kernel=1, budget=4, head_dim=DH)
    assert _kept(edit, kv, _tokens(12)) == [3, 7, 10, 11]
    qc = q[None]  # qcache's [1, L, Tq, Hq*Dh]
    assert _kept(edits.snapkv(qc, window=2, kernel=1, budget=4, head_dim=DH), kv,
                 _tokens(12)) == [3, 7, 10, 11]


def test_snapkv_from_a_stream_mapping_and_a_callable() -> None:
    """modify's {KV, QUERY} mapping and a per-sequence callable give the same selection."""
    kv, q = _gqa_case()
    inp = {LMCacheSDKCacheKind.KV: kv, LMCacheSDKCacheKind.QUERY: q[None]}
    out, tok = edits.snapkv(window=2, kernel=1, budget=4, head_dim=DH)(inp, _tokens(12))
    assert [t - 100 for t in tok] == [3, 7, 10, 11] and torch.equal(out, kv[:, :, [3, 7, 10, 11]])
    edit = edits.snapkv(lambda tokens: q, window=2, kernel=1, budget=4, head_dim=DH)
    assert _kept(edit, kv, _tokens(12)) == [3, 7, 10, 11]


def test_snapkv_stream_queries_are_aligned_at_token_0() -> None:
    """A stream's QUERY tensor holds the prompt's queries from its first token (qcache).

    More rows than the KV (the KV's read covered fewer chunks): its first T are the KV's
    tokens' queries, so the selection is the aligned one. Fewer rows cannot hold the
    KV's last tokens: refused, never taken as the last Tq (which given queries mean).
    """
    kv, q = _gqa_case()
    extra = torch.randn(1, 3, q.shape[-1], generator=torch.Generator().manual_seed(9))
    longer = torch.cat([q, extra], dim=1)[None]
    inp = {LMCacheSDKCacheKind.KV: kv, LMCacheSDKCacheKind.QUERY: longer}
    _, tok = edits.snapkv(window=2, kernel=1, budget=4, head_dim=DH)(inp, _tokens(12))
    assert [t - 100 for t in tok] == [3, 7, 10, 11]
    inp[LMCacheSDKCacheKind.QUERY] = q[None, :, :10]
    with pytest.raises(InvalidArgumentError, match="covers 10 tokens but the KV 12"):
        edits.snapkv(window=2, kernel=1, budget=4, head_dim=DH)(inp, _tokens(12))
    inp[LMCacheSDKCacheKind.QUERY] = q[None]
    with pytest.raises(InvalidArgumentError, match="queries_at='after' with the stream"):
        edits.rkv(window=2, kernel=1, budget=4, head_dim=DH, queries_at="after")(inp, _tokens(12))


def _snapkv_reference(kv: torch.Tensor, q: torch.Tensor, window: int, kernel: int,
                      budget: int) -> list[int]:
    """SnapKV spelled out per layer and query head (repeat_kv grouping, causal window).

    Ties go to the earlier token, as in the edits.
    """
    layers, count = kv.shape[1], kv.shape[2]
    hkv, hq = kv.shape[3] // DH, q.shape[2] // DH
    total = torch.zeros(count - window)
    for layer in range(layers):
        k = kv[0, layer].reshape(count, hkv, DH).repeat_interleave(hq // hkv, dim=1)
        qq = q[layer, -window:].reshape(window, hq, DH)
        for h in range(hq):
            logits = qq[:, h] @ k[:, h].T / math.sqrt(DH)
            for i in range(window):
                logits[i, count - window + i + 1:] = float("-inf")
            att = logits.softmax(-1).sum(0)[: count - window]
            pooled = torch.nn.functional.max_pool1d(att[None, None], kernel, 1, kernel // 2)
            total += pooled.flatten()
    top = torch.sort(total, descending=True, stable=True).indices[: budget - window].tolist()
    return sorted(top) + list(range(count - window, count))


def test_snapkv_matches_a_plain_reference() -> None:
    """Random KV and queries (GQA 4:2, 2 layers): the same tokens as the plain reference."""
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 2, 40, 2 * DH, generator=gen)
    q = torch.randn(2, 40, 4 * DH, generator=gen)
    want = _snapkv_reference(kv, q, window=6, kernel=5, budget=16)
    assert _kept(edits.snapkv(q, window=6, kernel=5, budget=16, head_dim=DH), kv,
                 _tokens(40)) == want


def test_short_sequences_keep_their_protected_tokens() -> None:
    """A ratio below the window or sinks + recent keeps those; fewer queries shrink the window."""
    kv, q = _gqa_case()
    assert _kept(edits.snapkv(q, window=4, kernel=1, ratio=0.1, head_dim=DH), kv,
                 _tokens(12)) == [8, 9, 10, 11]
    assert _kept(edits.snapkv(q[:, -3:], window=4, kernel=1, budget=5, head_dim=DH), kv,
                 _tokens(12)) == [3, 7, 9, 10, 11]
    assert _kept(edits.keep_ratio(0.1, "uniform", sinks=1, recent=2), _kv(), _tokens(10)) == \
        [0, 8, 9]


def test_snapkv_queries_after_the_kv() -> None:
    """queries_at='after': every key visible, nothing forced; the attended tokens win."""
    kv, q = _gqa_case()
    edit = edits.snapkv(q[:, -2:], window=2, kernel=1, budget=2, head_dim=DH,
                        queries_at="after")
    assert _kept(edit, kv, _tokens(12)) == [3, 7]


# ------------------------------------------------------------------ R-KV
def test_rkv_drops_redundant_keys() -> None:
    """With uniform attention, R-KV keeps distinct keys and drops near-duplicates."""
    eye = torch.eye(DH)
    rows = [eye[0] * (1 + 0.01 * i) for i in range(4)] + [eye[i] for i in range(2, 8)]
    kv = _keys_with(rows, heads=1)
    q = torch.zeros(1, 10, 2 * DH)  # 2 query heads on 1 KV head: uniform attention
    edit = edits.rkv(q, window=2, kernel=1, budget=7, head_dim=DH)
    kept = _kept(edit, kv, _tokens(10))
    assert kept[-6:] == [4, 5, 6, 7, 8, 9] and len([i for i in kept if i < 4]) == 1


def test_rkv_lam_one_is_window_attention() -> None:
    """lam=1: only importance counts, so the GQA case keeps SnapKV's choice."""
    kv, q = _gqa_case()
    edit = edits.rkv(q, window=2, kernel=1, budget=4, lam=1.0, head_dim=DH)
    assert _kept(edit, kv, _tokens(12)) == [3, 7, 10, 11]


# ------------------------------------------------------------------ rope and chains
def _all_edits(rope: edits.RoPE | None) -> dict[str, object]:
    _, q = _gqa_case()
    return {
        "keep": edits.keep([0, 4, 9], rope=rope),
        "drop_every": edits.drop_every(3, rope=rope),
        "keep_ratio": edits.keep_ratio(0.5, head_dim=DH, rope=rope),
        "keep_budget": edits.keep_budget(5, "l2", head_dim=DH, rope=rope),
        "streaming_llm": edits.streaming_llm(2, 4, rope=rope),
        "key_norm": edits.key_norm(0.4, head_dim=DH, rope=rope),
        "snapkv": edits.snapkv(q, window=2, kernel=3, budget=5, head_dim=DH, rope=rope),
        "rkv": edits.rkv(q, window=2, kernel=3, budget=5, head_dim=DH, rope=rope),
    }


@pytest.mark.parametrize("name", list(_all_edits(None)))
def test_rope_rerotates_the_kept_keys_to_0_t(name: str) -> None:
    """With rope, K == rerotate(kept rows, old indices -> 0..T'-1); V and tokens unchanged."""
    kv, _ = _gqa_case()
    before = kv.clone()
    plain, tok = _all_edits(None)[name](kv, _tokens(12))
    rotated, tok_r = _all_edits(ROPE)[name](kv, _tokens(12))
    assert torch.equal(kv, before), "the caller's KV changed"
    assert tok == tok_r
    idx = [t - 100 for t in tok]
    assert torch.equal(rotated[1], plain[1])
    torch.testing.assert_close(rotated, edits.rerotate(plain, idx, ROPE), rtol=0, atol=0)
    if idx != list(range(len(idx))):
        assert not torch.equal(rotated[0], plain[0])


def test_chain_composes_selections() -> None:
    """chain(drop_every(2), keep([0, 2])) == keep of the composed indices, rope included."""
    kv, tok = _kv(count=10), _tokens(10)
    out, t = edits.chain(edits.drop_every(2, rope=ROPE), edits.keep([0, 2], rope=ROPE))(kv, tok)
    want, wt = edits.keep([0, 4], rope=ROPE)(kv, tok)
    assert t == wt == [100, 104]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(("make", "match"), [
    (lambda: edits.drop_every(1), "k >= 2"),
    (lambda: edits.keep([1, 1]), "duplicate"),
    (lambda: edits.keep([-1]), ">= 0"),
    (lambda: edits.streaming_llm(0, 0), "at least one"),
    (lambda: edits.keep_ratio(1.5), "ratio"),
    (lambda: edits.keep_ratio(0.5), "head_dim"),
    (lambda: edits.keep_ratio(0.5, "best", head_dim=DH), "best"),
    (lambda: edits.keep_ratio(0.5, head_dim=DH, aggregate="sum"), "sum"),
    (lambda: edits.key_norm(head_dim=DH), "exactly one"),
    (lambda: edits.snapkv(None, window=2, kernel=4, budget=4, head_dim=DH), "odd"),
    (lambda: edits.rkv(None, budget=16, lam=2.0, head_dim=DH), "lam"),
    (lambda: edits.snapkv(None, window=6, budget=4, head_dim=DH), "cannot hold the window"),
    (lambda: edits.keep_budget(3, "uniform", sinks=2, recent=2), "cannot hold"),
])
def test_bad_arguments_are_named(make, match: str) -> None:
    """Bad construction arguments: an InvalidArgumentError naming them."""
    with pytest.raises(InvalidArgumentError, match=match):
        make()


def test_bad_call_inputs_are_named() -> None:
    """Wrong tokens count, a KV not [2, L, T, D], an index past T, GQA and query shapes."""
    kv, q = _gqa_case()
    with pytest.raises(InvalidArgumentError, match="expected 12 tokens"):
        edits.drop_every(2)(kv, _tokens(11))
    with pytest.raises(InvalidArgumentError, match=r"\[2, L, T, D\]"):
        edits.drop_every(2)(kv[0], _tokens(12))
    with pytest.raises(InvalidArgumentError, match="out of range"):
        edits.keep([12])(kv, _tokens(12))
    with pytest.raises(InvalidArgumentError, match="multiple"):
        edits.snapkv(q[..., : 3 * DH], window=2, kernel=1, budget=4, head_dim=DH)(kv, _tokens(12))
    with pytest.raises(InvalidArgumentError, match="L=1"):
        edits.snapkv(q.expand(2, -1, -1), window=2, budget=4, head_dim=DH)(kv, _tokens(12))
    with pytest.raises(InvalidArgumentError, match="no query tensors") as info:
        edits.snapkv(window=2, budget=4, head_dim=DH)(kv, _tokens(12))
    assert isinstance(info.value, (ValueError, KVCacheSDKError))
    with pytest.raises(InvalidTypeError, match="RoPE"):
        edits.drop_every(2, rope="llama")  # type: ignore[arg-type]


def test_same_result_under_pooled_outputs() -> None:
    """Under batch.rewrite's pooled edit outputs (>= 1 MiB results) every edit is unchanged."""
    from lmcache_kv_fast.batch._policy import PooledOutputs
    from lmcache_kv_fast.copy.select import backend

    if backend().NAME != "native":
        pytest.skip("pooled outputs need the native core")
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 4, 512, 8 * DH, generator=gen).to(torch.bfloat16)  # 2 MiB per plane
    q = torch.randn(4, 512, 16 * DH, generator=gen).to(torch.bfloat16)
    tok = _tokens(512)
    for edit in (edits.drop_every(10, rope=ROPE), edits.key_norm(0.5, head_dim=DH, rope=ROPE),
                 edits.snapkv(q, 16, 5, ratio=0.3, head_dim=DH, rope=ROPE),
                 edits.rkv(q, 8, 5, ratio=0.5, head_dim=DH, rope=ROPE)):
        want = edit(kv, tok)
        with PooledOutputs(backend().alloc_result):
            got = edit(kv, tok)
        assert got[1] == want[1] and torch.equal(got[0], want[0]), edit


# ------------------------------------------------------------------ the fast forms
def _reference_redundancy(k: torch.Tensor, head_dim: int, threshold: float) -> torch.Tensor:
    """R-KV's redundancy as first written: the full ``[H, T, T]`` matrix per layer."""
    out = []
    for layer in range(k.shape[0]):
        kh = torch.nn.functional.normalize(
            k[layer].unflatten(-1, (-1, head_dim)).float().transpose(0, 1), dim=-1)
        sim = torch.bmm(kh, kh.transpose(1, 2))
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        sim = torch.nn.functional.threshold(sim, threshold, 0.0, inplace=True)
        out.append(sim.mean(dim=-1).softmax(dim=-1))
    return torch.stack(out)


def _reference_rkv(kv: torch.Tensor, q: torch.Tensor, *, window: int, kernel: int, n: int,
                   lam: float, threshold: float, head_dim: int) -> list[int]:
    """R-KV's selection as first written: per-head attention and the full similarity."""
    layers, count = kv.shape[1], kv.shape[2]
    k = kv[0]
    scores = []
    for layer in range(layers):
        qh = q[layer, -window:].unflatten(-1, (-1, head_dim)).float()  # [W, Hq, Dh]
        kh = k[layer].unflatten(-1, (-1, head_dim)).float()  # [T, Hkv, Dh]
        g = qh.shape[1] // kh.shape[1]
        logits = torch.einsum("whd,thd->hwt", qh, kh.repeat_interleave(g, dim=1))
        logits = logits * head_dim ** -0.5
        mask = torch.arange(count)[None, :] > torch.arange(count - window, count)[:, None]
        att = logits.masked_fill(mask, float("-inf")).softmax(-1).sum(1)  # [Hq, T]
        imp = att.view(kh.shape[1], g, count).mean(1) / window
        prefix = count - window
        pooled = torch.nn.functional.max_pool1d(imp[:, None, :prefix], kernel, 1, kernel // 2)
        imp = torch.cat([pooled[:, 0], torch.zeros(imp.shape[0], window)], dim=1)
        scores.append(imp)
    imp = torch.stack(scores)
    score = lam * imp - (1 - lam) * _reference_redundancy(k, head_dim, threshold)
    total = score.reshape(-1, count).mean(0)
    total[count - window:] = float("inf")
    order = torch.sort(total, descending=True, stable=True).indices
    return order[:n].sort().values.tolist()


@pytest.mark.parametrize("count,threshold,dtype", [
    (257, 0.5, torch.bfloat16), (600, 0.1, torch.float32), (1000, -0.2, torch.bfloat16),
    (129, 0.9, torch.float16)])
def test_rkv_selects_what_the_full_matrix_selects(count: int, threshold: float,
                                                  dtype: torch.dtype) -> None:
    """The strip-wise symmetric redundancy keeps exactly the first (full-matrix) selection.

    Random keys drawn around a few centres (so many pairs pass the threshold), GQA
    queries; the redundancy itself agrees to float32 rounding.
    """
    gen = torch.Generator().manual_seed(count)
    centres = torch.randn(3, 12, 4 * DH, generator=gen)
    pick = torch.randint(0, 12, (count,), generator=gen)
    k = centres[:, pick] + 0.6 * torch.randn(3, count, 4 * DH, generator=gen)
    kv = torch.stack([k, torch.randn(3, count, 4 * DH, generator=gen)]).to(dtype)
    q = torch.randn(3, 16, 8 * DH, generator=gen).to(dtype)
    from lmcache_kv_fast.edits._scores import redundancy

    want = _reference_redundancy(kv[0], DH, threshold)
    torch.testing.assert_close(redundancy(kv[0], DH, threshold), want, rtol=1e-5, atol=1e-9)
    n = count // 2
    for window in (8, 16):
        edit = edits.rkv(q, window, 7, budget=n, lam=0.1, threshold=threshold, head_dim=DH)
        got = _kept(edit, kv, _tokens(count))
        assert got == _reference_rkv(kv, q, window=window, kernel=7, n=n, lam=0.1,
                                     threshold=threshold, head_dim=DH)


def test_key_scores_match_torch_cosine_and_norm() -> None:
    """KeyDiff's score is minus torch's cosine similarity to the mean key; L2 the norm ratio."""
    from lmcache_kv_fast.edits._scores import key_scores

    k = _kv(layers=3, count=300, heads=4, dtype=torch.bfloat16)[0]
    kh = k.unflatten(-1, (4, DH)).float().transpose(1, 2)  # [L, H, T, Dh]
    cos = torch.nn.functional.cosine_similarity(kh, kh.mean(2, keepdim=True), dim=-1)
    torch.testing.assert_close(key_scores(k, DH, "keydiff"), -cos, rtol=1e-5, atol=1e-6)
    norm = kh.norm(dim=-1)
    torch.testing.assert_close(key_scores(k, DH, "l2"), -norm / norm.mean(-1, keepdim=True))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rerotate_equals_the_complex_product(interleaved: bool) -> None:
    """The chunked real-arithmetic rotation equals one complex64 product per pair."""
    rope = edits.rope_from_config({"model_type": "llama", "hidden_size": 32, "head_dim": DH,
                                   "num_attention_heads": 4, "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.75}, interleaved=interleaved)
    kv = _kv(layers=3, count=700, heads=4)
    old = torch.arange(700) * 3 // 2
    got = edits.rerotate(kv, old, rope)
    half, rot = rope.rotary_dim // 2, rope.rotary_dim
    angle = (torch.arange(700) - old).double()[:, None] * rope.inv_freq().double()[None, :]
    x = kv[0].unflatten(-1, (4, DH))[..., :rot]
    pairs = x.unflatten(-1, (half, 2)) if interleaved else x.unflatten(-1, (2, half)).transpose(-1, -2)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(
        torch.ones_like(angle), angle).to(torch.complex64)[:, None, :]
    want = kv.clone()
    want_pairs = want[0].unflatten(-1, (4, DH))[..., :rot]
    want_pairs = want_pairs.unflatten(-1, (half, 2)) if interleaved else \
        want_pairs.unflatten(-1, (2, half)).transpose(-1, -2)
    want_pairs.copy_(torch.view_as_real(z))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], kv[1])
    assert torch.equal(got[0].unflatten(-1, (4, DH))[..., rot:],
                       kv[0].unflatten(-1, (4, DH))[..., rot:])
