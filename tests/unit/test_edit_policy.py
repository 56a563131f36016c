"""The edit policy of batches: pooled op outputs give the plain call's results bit for bit,
never recycle memory under a live tensor, and the thread policy touches only its thread."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from lmcache_kv_fast.batch._policy import (
    ENV_EDIT_THREADS,
    ENV_POOL_OUTPUTS,
    MIN_POOLED_BYTES,
    EditPolicy,
    EditRunner,
    PooledOutputs,
    out_plan,
    set_thread_intraop_threads,
)
from lmcache_kv_fast.copy.select import backend
from lmcache_kv_fast.errors import InvalidArgumentError

native = pytest.mark.skipif(backend().NAME != "native", reason="pooled outputs need the native core")


def _kv(seed: int = 0, shape=(2, 4, 1024, 512)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=torch.bfloat16)
    t.view(torch.int16).random_(0, 16000, generator=g)
    return t


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if not isinstance(a, torch.Tensor):
        return a == b
    if (a.dtype, a.shape, a.stride()) != (b.dtype, b.shape, b.stride()):
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


KEEP = torch.tensor([i for i in range(1024) if i % 10 != 9])
EDITS = {
    "index_select": lambda kv: kv.index_select(2, KEEP),
    "advanced_index": lambda kv: kv[:, :, KEEP],
    "cat": lambda kv: torch.cat([kv[:, :, :100], kv[:, :, 500:]], dim=2),
    "stack": lambda kv: torch.stack([kv[0], kv[1]]),
    "clone": lambda kv: kv.clone(),
    "contiguous_of_permuted": lambda kv: kv.transpose(2, 3).contiguous(),
    "to_float": lambda kv: kv.to(torch.float32),
    "float_mul_back": lambda kv: (kv.float() * 0.5).to(torch.bfloat16),
    "mul_scalar": lambda kv: kv * 2,
    "add": lambda kv: kv + kv.flip(2),
    "where": lambda kv: torch.where(kv > 1, kv, torch.zeros((), dtype=kv.dtype)),
    "narrow_contiguous": lambda kv: kv.narrow(2, 3, 700).contiguous(),
    "roll": lambda kv: kv.roll(5, 2),
    "gather": lambda kv: kv.gather(2, torch.arange(512).expand(2, 4, 512, 512).contiguous()),
    "pad": lambda kv: F.pad(kv, (0, 0, 0, 16)),
    "zeros_like": lambda kv: torch.zeros_like(kv),
    "mean_small": lambda kv: kv.float().mean(-1),
    "permuted_elementwise": lambda kv: kv.permute(0, 1, 3, 2) * 1,
    "masked_select": lambda kv: kv.masked_select(kv > 2),
    "topk_multi_output": lambda kv: kv.float().topk(3, dim=-1),
    "inplace_on_clone": lambda kv: kv.clone().mul_(3),
    "view_only": lambda kv: kv[:, :, 10:20],
    "repeat_interleave": lambda kv: kv[:, :, :256].repeat_interleave(2, dim=2),
    "sub_same_shape": lambda kv: kv - kv.flip(2),
    "maximum": lambda kv: torch.maximum(kv, kv.flip(2)),
    "where_two_tensors": lambda kv: torch.where(kv > 1, kv, kv.flip(2)),
    "cat_mixed_dtypes": lambda kv: torch.cat([kv[:, :, :100].float(), kv[:, :, 500:]], dim=2),
    "add_broadcast": lambda kv: kv + kv[:, :, :1],
    "cat_of_transposed": lambda kv: torch.cat([kv.transpose(2, 3), kv.transpose(2, 3)], 3),
    "index_put": lambda kv: kv.index_put((torch.tensor([0]),), torch.zeros(4, 1024, 512,
                                                                           dtype=kv.dtype)),
}


@native
@pytest.mark.parametrize("name", sorted(EDITS))
def test_pooled_outputs_equal_plain_call(name):
    kv = _kv()
    want = EDITS[name](kv)
    mode = PooledOutputs(backend().alloc_result)
    with mode:
        got = EDITS[name](kv)
    assert _same(got, want), name
    assert torch.equal(kv.view(torch.int16), _kv().view(torch.int16))  # input untouched
    if name in ("index_select", "advanced_index", "cat", "clone", "to_float", "mul_scalar", "float_mul_back",
                "contiguous_of_permuted", "roll", "pad", "stack", "where", "gather",
                "sub_same_shape", "maximum", "where_two_tensors", "cat_mixed_dtypes",
                "add_broadcast"):
        assert mode.pooled >= 1, name  # these really came from the pool


@native
def test_random_ops_are_left_alone():
    kv = _kv()
    torch.manual_seed(3)
    want = torch.rand_like(kv, dtype=torch.float32) + kv
    torch.manual_seed(3)
    with PooledOutputs(backend().alloc_result):
        got = torch.rand_like(kv, dtype=torch.float32) + kv
    assert _same(got, want)


@native
def test_kept_outputs_are_never_recycled():
    """An edit that keeps what it made (or a copy) keeps valid memory: a buffer goes back to
    the pool only when the last tensor over it dies."""
    mode = PooledOutputs(backend().alloc_result)
    kept, ptrs = [], []
    for i in range(6):
        with mode:
            out = _kv(i).index_select(2, KEEP)
        kept.append(out)
        ptrs.append(out.data_ptr())
    assert len(set(ptrs)) == 6  # all alive: all distinct
    for i, out in enumerate(kept):
        assert torch.equal(out.view(torch.int16), _kv(i).index_select(2, KEEP).view(torch.int16))
    kept.clear()  # now they go back to the pool: the next outputs are warm pool hits
    from lmcache_kv_fast import _native

    hits = _native.result_pool_stats()["hits"]
    for i in range(4):
        with mode:
            out = _kv(i).index_select(2, KEEP)
        assert torch.equal(out.view(torch.int16), _kv(i).index_select(2, KEEP).view(torch.int16))
        del out
    assert _native.result_pool_stats()["hits"] - hits >= 4


@native
def test_outputs_from_1_mib_are_pooled():
    """A small stream's token drop (2 MiB of KV, 1.8 MiB kept) comes from the pool, not
    from glibc's heap, which such outputs make grow; outputs under 1 MiB do not."""
    assert MIN_POOLED_BYTES == 1 << 20
    kv = _kv(shape=(2, 2, 2048, 128))  # bf16: 2 MiB
    keep = torch.tensor([i for i in range(2048) if i % 10 != 9])
    mode = PooledOutputs(backend().alloc_result)
    with mode:
        big = kv.index_select(2, keep)  # 1.8 MiB
    assert mode.pooled == 1 and big.data_ptr() % (2 << 20) == 0  # a pool region
    assert _same(big, kv.index_select(2, keep))
    with mode:
        half = kv[:, :, :1024].index_select(2, keep[keep < 1024])  # 0.9 MiB
    assert mode.pooled == 1
    assert _same(half, kv[:, :, :1024].index_select(2, keep[keep < 1024]))


@native
def test_explicit_out_and_small_outputs_pass_through():
    kv = _kv()
    buf = torch.empty((2, 4, len(KEEP), 512), dtype=kv.dtype)
    mode = PooledOutputs(backend().alloc_result)
    with mode:
        r = torch.index_select(kv, 2, KEEP, out=buf)
        small = kv[:, :, :8].clone()
    assert r is buf and mode.pooled == 0
    assert _same(small, kv[:, :, :8].clone())


def test_out_plan_matches_only_functional_single_output_ops():
    aten = torch.ops.aten
    assert out_plan(aten.index_select.default).out_name == "out"
    assert out_plan(aten.cat.default) is not None
    assert out_plan(aten.add.Tensor) is not None
    assert out_plan(aten.mul_.Tensor) is None  # in place
    assert out_plan(aten.slice.Tensor) is None  # view
    assert out_plan(aten.topk.default) is None  # two outputs
    assert out_plan(aten.bernoulli.default) is None  # random
    assert out_plan(aten.nonzero.default) is None  # data-dependent shape
    assert out_plan(aten._to_copy.default).drop  # dtype comes from the output


@native
def test_runner_reruns_an_edit_that_resizes_a_pooled_output():
    calls = []

    def fn(kv):
        calls.append(1)
        x = kv.clone()
        x.resize_(2, 4, 4096, 512)  # grows beyond the pooled storage
        x[:, :, :1024].copy_(kv)
        return x[:, :, :1024].clone()

    r = EditRunner(EditPolicy(True, None), backend().alloc_result, grad_enabled=False,
                   inference_mode=False)
    r.setup()
    kv = _kv()
    out = r.call(fn, kv)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    assert len(calls) == 2 and r.mode is None


def test_runner_applies_callers_grad_mode():
    seen = {}

    def fn():
        seen["grad"] = torch.is_grad_enabled()
        seen["inf"] = torch.is_inference_mode_enabled()

    for grad, inf in ((True, False), (False, False), (False, True)):
        r = EditRunner(EditPolicy(False, None), None, grad_enabled=grad, inference_mode=inf)
        t = threading.Thread(target=lambda r=r: (r.setup(), r.call(fn)))
        t.start()
        t.join()
        assert seen == {"grad": grad, "inf": inf}


def test_thread_policy_changes_only_its_thread():
    before = torch.get_num_threads()
    got = {}

    def edit_thread():
        got["set"] = set_thread_intraop_threads(1)
        got["inside"] = torch.get_num_threads()

    t = threading.Thread(target=edit_thread)
    t.start()
    t.join()
    if got["set"]:
        assert got["inside"] == 1
    assert torch.get_num_threads() == before  # the caller's thread
    later = {}
    t = threading.Thread(target=lambda: later.setdefault("n", torch.get_num_threads()))
    t.start()
    t.join()
    assert later["n"] == before  # threads started later keep torch's default


def test_policy_resolution(monkeypatch):
    monkeypatch.delenv(ENV_POOL_OUTPUTS, raising=False)
    monkeypatch.delenv(ENV_EDIT_THREADS, raising=False)
    p = EditPolicy.resolve(None, None, cores=2, caller_threads=2, native=True)
    assert p.pool_outputs and p.threads == 2
    assert EditPolicy.resolve(None, None, cores=8, caller_threads=8, native=True).threads == 8
    assert EditPolicy.resolve(None, None, cores=8, caller_threads=2, native=True).threads == 2
    assert EditPolicy.resolve(None, None, cores=1, caller_threads=2, native=True).threads == 1
    assert not EditPolicy.resolve(None, None, cores=2, caller_threads=2, native=False).pool_outputs
    assert not EditPolicy.resolve(False, 3, cores=2, caller_threads=2, native=True).pool_outputs
    monkeypatch.setenv(ENV_POOL_OUTPUTS, "0")
    monkeypatch.setenv(ENV_EDIT_THREADS, "2")
    p = EditPolicy.resolve(None, None, cores=2, caller_threads=2, native=True)
    assert not p.pool_outputs and p.threads == 2
    assert EditPolicy.resolve(True, 1, cores=2, caller_threads=2, native=True) == EditPolicy(True, 1)
    monkeypatch.setenv(ENV_POOL_OUTPUTS, "maybe")
    with pytest.raises(InvalidArgumentError, match=ENV_POOL_OUTPUTS):
        EditPolicy.resolve(None, None, cores=2, caller_threads=2, native=True)
    monkeypatch.setenv(ENV_POOL_OUTPUTS, "1")
    monkeypatch.setenv(ENV_EDIT_THREADS, "0")
    with pytest.raises(InvalidArgumentError, match=ENV_EDIT_THREADS):
        EditPolicy.resolve(None, None, cores=2, caller_threads=2, native=True)
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(InvalidArgumentError, match="edit_threads"):
            EditPolicy.resolve(None, bad, cores=2, caller_threads=2, native=True)
    with pytest.raises(InvalidArgumentError, match="pool_outputs"):
        EditPolicy.resolve("yes", None, cores=2, caller_threads=2, native=True)
