"""SnapKV on a real model's queries: its scores are transformers' own attention (fast tier).

The oracle is transformers 5 in the engine venv (``testbed.oracle.TransformersOracle``) on
the project's tiny Llama (2 layers, 4 query heads on 2 KV heads of 64): one forward gives
the prompt's KV, and another with eager attention and ``output_attentions=True`` gives the
post-RoPE query states of the last ``window`` positions and the probabilities transformers
computes for those rows. ``edits.snapkv`` given those queries must score exactly that
attention (to float32 rounding) and keep what a plain reference computed from
transformers' probabilities keeps, for every pooling, aggregation and layer choice
docs/edits.md promises. Skips, naming the missing venv, without ``.venv-engine``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmcache_kv_fast import edits
from lmcache_kv_fast.edits._scores import window_attention
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind

T, W, KERNEL = 300, 32, 7
KEPT = 120  # ratio 0.4 of 300



@pytest.fixture(scope="module")
def model_run(oracle_model: Path) -> dict:
    """KV, window queries and attention, and all T queries, of one random prompt."""
    from testbed.oracle import TransformersOracle

    tokens = torch.randint(0, 1024, (T,), generator=torch.Generator().manual_seed(21)).tolist()
    with TransformersOracle(oracle_model) as oracle:
        kv = oracle.kv(tokens)
        q, att = oracle.window_attention(tokens, W)
        q_all, att_all = oracle.window_attention(tokens, T)
    return {"tokens": tokens, "kv": kv, "q": q, "att": att, "q_all": q_all,
            "att_all": att_all, "rope": edits.rope_from_config(oracle_model)}


def flat(q: torch.Tensor) -> torch.Tensor:
    """The oracle's ``[L, Hq, Tq, Dh]`` as the edits' ``[L, Tq, Hq*Dh]`` (vLLM's row form)."""
    return q.permute(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)


def reference(att: torch.Tensor, kernel: int, kept: int, pooling: str = "max",
              aggregate: str = "mean", layers: list[int] | None = None) -> list[int]:
    """SnapKV written out over transformers' own probabilities ``[L, Hq, W, T]``.

    Sum over the window's rows, pool each (layer, query head) over the tokens before the
    window, reduce over the chosen layers and every query head, keep the best (ties to
    the earlier token) plus the window.
    """
    window, count = att.shape[2], att.shape[3]
    score = att.sum(dim=2)[..., : count - window]
    if layers is not None:
        score = score[layers]
    rows = score.reshape(-1, 1, count - window)
    if pooling == "max":
        rows = F.max_pool1d(rows, kernel, 1, kernel // 2)
    else:
        rows = F.avg_pool1d(rows, kernel, 1, kernel // 2, count_include_pad=False)
    rows = rows.reshape(-1, count - window)
    total = rows.mean(dim=0) if aggregate == "mean" else rows.amax(dim=0)
    top = torch.sort(total, descending=True, stable=True).indices[: kept - window]
    return sorted(top.tolist()) + list(range(count - window, count))


def kept_by(edit, run: dict, queries=None) -> list[int]:
    """Indices ``edit`` keeps of the prompt (KV given alone, or with a QUERY tensor).

    The tokens passed are the indices themselves, so the kept tokens name the rows.
    """
    inp = run["kv"] if queries is None else {LMCacheSDKCacheKind.KV: run["kv"],
                                             LMCacheSDKCacheKind.QUERY: queries}
    out, toks = edit(inp, list(range(T)))
    assert out.shape[2] == len(toks) and toks == sorted(toks)
    return toks


def test_scores_are_transformers_attention(model_run: dict) -> None:
    """Window attention from the queries and K equals transformers' probabilities.

    Per (layer, query head), summed over the window: query head h reads KV head
    ``h // 2`` (repeat_kv), the causal mask hides each row's later keys, the scale is
    ``head_dim ** -0.5``. A wrong GQA grouping (h % 2) is far off, so the check has teeth.
    """
    kv, q, att = model_run["kv"], model_run["q"], model_run["att"]
    ours = window_attention(flat(q), kv[0], 64, W, at_end=True)
    want = att.sum(dim=2)
    assert ours.shape == want.shape == (2, 4, T)
    torch.testing.assert_close(ours, want, rtol=0, atol=2e-6)
    # transformers' rows are causal: row i sees keys up to T - W + i
    assert float(att[..., 0, T - W + 1:].abs().max()) == 0.0
    tiled = flat(q[:, [0, 2, 1, 3]])  # query heads swapped across KV groups
    wrong = window_attention(tiled, kv[0], 64, W, at_end=True)[:, [0, 2, 1, 3]]
    assert float((wrong - want).abs().max()) > 1000 * 2e-6


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("aggregate", ["mean", "max"])
@pytest.mark.parametrize("layers", [None, [0], [1]])
def test_snapkv_keeps_what_transformers_attention_picks(model_run: dict, pooling: str,
                                                        aggregate: str, layers) -> None:
    """The kept set equals the reference on transformers' probabilities, for each choice."""
    want = reference(model_run["att"], KERNEL, KEPT, pooling, aggregate, layers)
    edit = edits.snapkv(flat(model_run["q"]), W, KERNEL, ratio=0.4, pooling=pooling,
                        aggregate=aggregate, layers=layers, head_dim=64)
    assert kept_by(edit, model_run) == want
    assert len(want) == KEPT and want[-W:] == list(range(T - W, T))


def test_the_choices_matter_on_this_model(model_run: dict) -> None:
    """Mean vs max over heads and layer 0 vs layer 1 keep different tokens here, so the
    parametrised equality above checks each choice, not one answer for all."""
    att = model_run["att"]
    assert reference(att, KERNEL, KEPT, aggregate="mean") != \
        reference(att, KERNEL, KEPT, aggregate="max")
    assert reference(att, KERNEL, KEPT, layers=[0]) != reference(att, KERNEL, KEPT, layers=[1])
    assert reference(att, KERNEL, KEPT, pooling="max") != \
        reference(att, KERNEL, KEPT, pooling="avg")


def test_all_queries_in_every_form_pick_the_same(model_run: dict) -> None:
    """All T queries (qcache's ``[1, L, T, Hq*Dh]``, a callable, a stream's QUERY) use the
    last W as the window: the same tokens as the W queries alone, with ``rope`` too."""
    q_all = flat(model_run["q_all"])
    torch.testing.assert_close(q_all[:, T - W:], flat(model_run["q"]), rtol=0, atol=1e-6)
    want = reference(model_run["att"], KERNEL, KEPT)
    rope = model_run["rope"]
    for edit, given in ((edits.snapkv(q_all[None], W, KERNEL, ratio=0.4, head_dim=64), None),
                        (edits.snapkv(lambda t: q_all, W, KERNEL, ratio=0.4, rope=rope), None),
                        (edits.snapkv(None, W, KERNEL, ratio=0.4, rope=rope), q_all[None])):
        assert kept_by(edit, model_run, given) == want
