"""edits.row_plan / plannable: a library edit planned without its KV equals the edit itself."""

from __future__ import annotations

import pytest
import torch

from lmcache_kv_fast import edits
from lmcache_kv_fast.copy.edit_kernels import gather_tokens
from lmcache_kv_fast.errors import InvalidArgumentError

HEAD = 64
ROPE = edits.rope_from_config({"rope_theta": 10000.0, "head_dim": HEAD,
                               "max_position_embeddings": 4096})
OTHER = edits.rope_from_config({"rope_theta": 500000.0, "head_dim": HEAD,
                                "max_position_embeddings": 4096})


def _kv(count: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, count, 4 * HEAD), generator=g).to(torch.bfloat16)


def _apply(plan: edits.RowPlan, kv: torch.Tensor) -> torch.Tensor:
    """The plan on a tensor: gather, then the plan's rotation (torch's rounding)."""
    out = gather_tokens(kv, plan.index, plan.rotation)
    if out is None:  # the torch backend: the same values by torch
        out = kv.index_select(2, plan.index)
        if plan.rotation is not None:
            out = edits.rerotate(out, plan.index, plan.rope)
    return out


SINGLE = [edits.drop_every(10), edits.drop_every(3, rope=ROPE), edits.keep([0, 5, 6, 99]),
          edits.keep([1, 2, 3], rope=ROPE), edits.streaming_llm(4, 30, rope=ROPE),
          edits.keep_ratio(0.4, "uniform", sinks=2, recent=5, rope=ROPE),
          edits.keep_budget(17, "random", seed=3)]


@pytest.mark.parametrize("fn", SINGLE, ids=lambda f: type(f).__name__)
@pytest.mark.parametrize("count", [100, 257])
def test_single_steps_plan_exactly_what_they_do(fn, count):
    toks = list(range(1000, 1000 + count))
    kv = _kv(count)
    want, want_toks = fn(kv, toks)
    assert edits.plannable(fn)
    plan = edits.row_plan(fn, toks)
    assert plan is not None and plan.tokens == want_toks
    assert torch.equal(_apply(plan, kv).view(torch.int16), want.view(torch.int16))
    assert (plan.rotation is None) == (fn.rope is None)


def test_chains_compose_indices_and_one_rotation():
    fn = edits.chain(edits.drop_every(4, rope=ROPE), edits.streaming_llm(3, 40, rope=ROPE))
    toks = list(range(200))
    kv = _kv(200, seed=1)
    want, want_toks = fn(kv, toks)
    plan = edits.row_plan(fn, toks)
    assert plan is not None and plan.tokens == want_toks
    got = _apply(plan, kv)
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))  # V as is
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2 ** -7, atol=2 ** -6)


def test_a_step_without_rope_keeps_positions_from_the_step_before():
    fn = edits.chain(edits.drop_every(2, rope=ROPE), edits.drop_every(5))
    plan = edits.row_plan(fn, list(range(40)))
    assert plan is not None
    # the second step keeps the first step's positions: each kept key sits at its index
    # in the first step's output, 2 * (its index) -> j for index 2j
    first = [i for i in range(40) if i % 2 != 1]
    kept = [first[j] for j in range(len(first)) if j % 5 != 4]
    assert plan.index.tolist() == kept
    cos = torch.cos((torch.tensor([first.index(i) for i in kept]) - torch.tensor(kept))
                    .double()[:, None] * ROPE.inv_freq().double()[None, :]).float()
    torch.testing.assert_close(plan.rotation.cos, cos)


@pytest.mark.parametrize("fn", [
    edits.key_norm(0.5, head_dim=HEAD),
    edits.snapkv(torch.zeros(3, 8, 4, HEAD), 4, 3, ratio=0.5, rope=ROPE),
    edits.chain(edits.drop_every(3, rope=ROPE), edits.drop_every(3, rope=OTHER)),
    edits.chain(edits.drop_every(3), edits.key_norm(0.5, head_dim=HEAD)),
    lambda kv, toks: (kv, toks),
], ids=["keydiff", "snapkv", "two-ropes", "chain-scored", "lambda"])
def test_what_reads_the_kv_is_not_planned(fn):
    assert not edits.plannable(fn)
    assert edits.row_plan(fn, list(range(50))) is None


def test_planning_refuses_what_the_edit_refuses():
    with pytest.raises(InvalidArgumentError, match="out of range"):
        edits.row_plan(edits.keep([3, 70]), list(range(50)))
    with pytest.raises(InvalidArgumentError):
        edits.row_plan(edits.drop_every(3), torch.zeros(2, 5))


def test_keeping_everything_needs_no_rotation():
    plan = edits.row_plan(edits.keep(range(30), rope=ROPE), list(range(30)))
    assert plan is not None and plan.rotation is None and plan.index.tolist() == list(range(30))
