"""W3F in this SDK's native worker: ``batch.rewrite`` on the tensor path vs the fused path.

Per rep, each on freshly seeded sequences (L1 cleared, W3's prompts stored again):
``batch.rewrite`` with W3P's plain fn (retrieve -> fn -> store on tensors), with
``edits.drop_every(k)`` and with ``edits.drop_every(k, rope=<llama3>)`` (the fused path:
each kept row goes once from the server's read-locked slots into the new sequence's
reserved slots in the core, K re-rotated in the same pass); and a flat memcpy of the
batch's input bytes (one sequence's bytes between two pre-faulted buffers, once per
sequence, the copies' times summed). Odd reps run them in reverse order. Each timed rep
then runs the three rewrites once more, untimed, while a thread samples the worker's
private memory (:class:`.helpers.PrivatePeak`). After the fused rewrites of the first
timed rep, every rewritten sequence is read back and compared with the library's edit of
the seeded KV on a tensor (V and a plain drop's K bit-exact, a re-rotated K up to one
bf16 rounding) and, for the re-rotation, with the same rotation written in plain torch.

Runs inside the worker interpreter (imported by :mod:`.worker_ops` when W3F begins).
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from .edits import (
    LLAMA3_8B_CONFIG,
    drop_every_kth_plain,
    dropped_tokens,
    llama3_8b_rope,
    llama3_inv_freq,
    rerotate_plain,
)
from .helpers import PrivatePeak
from .names import W3F_COPY, roofline
from .worker_ops import Broken, OpState, Worker
from .workloads import Driven, Variant, op_reps, workload_of

EditFn = Callable[[Any, Sequence[int]], tuple[Any, Any]]


def normal_kv(torch: Any, shape: Sequence[int], seed: int) -> Any:
    """Standard normal bf16 KV of ``shape`` ``[2, L, T, D]``, made one layer at a time.

    Real keys, not ``random_kv``'s bit patterns: those include bf16 denormals, on which a
    re-rotation's float32 arithmetic would measure the CPU's denormal assists.
    """
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(tuple(shape), dtype=torch.bfloat16)
    for layer in range(shape[1]):
        out[:, layer].copy_(torch.randn(shape[0], *shape[2:], generator=gen))
    return out


def edit_fns(k: int) -> tuple[EditFn, EditFn, EditFn]:
    """(W3P's plain fn, ``edits.drop_every(k)``, ``edits.drop_every(k, rope=<llama3>)``)."""
    from lmcache_kv_fast import edits

    def plain(kv: Any, toks: Sequence[int]) -> tuple[Any, list[int]]:
        return drop_every_kth_plain(kv, toks, k)

    rope = edits.rope_from_config(LLAMA3_8B_CONFIG)
    return plain, edits.drop_every(k), edits.drop_every(k, rope=rope)


def memcpy_fn(w: Worker, src: Any, times: int) -> Callable[[], float]:
    """Seconds of ``times`` flat copies of ``src``'s bytes into one pre-faulted buffer."""
    nat = w.native
    n = src.numel() * src.element_size()
    dst = w.torch.zeros(n, dtype=w.torch.uint8)  # written: every page faulted in
    nat.memcpy(dst.data_ptr(), src.data_ptr(), n)

    def copy() -> float:
        total = 0.0
        for _ in range(times):
            t0 = time.perf_counter()
            nat.memcpy(dst.data_ptr(), src.data_ptr(), n)
            total += time.perf_counter() - t0
        return total

    return copy


def _ulps(a: Any, b: Any) -> int:
    """Largest distance in bf16 steps between same-shape bf16 tensors ``a`` and ``b``."""
    import torch

    def ordered(t: Any) -> Any:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        mag = bits & 0x7FFF
        return torch.where(bits < 0, -mag, mag)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def _plain_rerotated(torch: Any, src: Any, k: int, count: int, n: int) -> Any:
    """The first ``n`` kept keys of ``src`` re-rotated in plain torch (4 layers at a time)."""
    keep = torch.tensor([i for i in range(count) if i % k != k - 1][:n])
    delta = torch.arange(n) - keep
    inv_freq = llama3_inv_freq(llama3_8b_rope())
    return torch.cat([rerotate_plain(src[0, lo:lo + 4][:, keep], delta, inv_freq)
                      for lo in range(0, src.shape[1], 4)])


def _close(got: Any, want: Any) -> bool:
    """Whether bf16 ``got`` is ``want`` up to one bf16 rounding (2^-7 relative, 2^-10 abs)."""
    diff = (got.float() - want.float()).abs()
    return bool((diff <= want.float().abs() * 2 ** -7 + 2 ** -10).all())


def verify(w: Worker, ctx: Any, src: Any, prompts: Sequence[list[int]], fn: EditFn, k: int,
           rerotated: bool) -> tuple[str, dict[str, Any]]:
    """Read back each rewritten sequence; ``(failure reason or "", facts)``.

    The reference is ``fn`` on the seeded KV as a tensor (the same KV under every prompt,
    so computed once): V and a plain drop's K bit-exact, a re-rotated K equal up to one
    bf16 rounding (``k_max_ulp``: bf16 steps apart at most). A re-rotated K's distance
    from :func:`.edits.rerotate_plain` (the rotation in plain torch, float32 then bf16) is
    reported, not checked: its float32 steps round differently now and then.
    """
    torch = w.torch
    want, want_toks = fn(src, prompts[0])
    if list(want_toks) != dropped_tokens(prompts[0], k):
        return "the library edit kept other tokens than every k-th dropped", {}
    n = len(want_toks) // ctx.chunk_size * ctx.chunk_size
    plain = _plain_rerotated(torch, src, k, len(prompts[0]), n) if rerotated else None
    facts: dict[str, Any] = {"sequences": 0, "tokens": n, "v_exact": True, "k_exact": True,
                             "k_close": True, "k_max_ulp": 0}
    if plain is not None:
        facts.update(plain_torch_max_abs=0.0, plain_torch_differ=0.0)
    for p in prompts:
        got = ctx.retrieve(dropped_tokens(p, k))
        if got is None or got.shape[2] != n:
            shape = None if got is None else tuple(got.shape)
            return f"read-back of a rewritten sequence: {shape}, want {n} tokens", facts
        facts["sequences"] += 1
        facts["v_exact"] &= bool(torch.equal(got[1].view(torch.int16),
                                             want[1, :, :n].view(torch.int16)))
        ulp = _ulps(got[0], want[0, :, :n])
        facts["k_max_ulp"] = max(facts["k_max_ulp"], ulp)
        facts["k_exact"] &= ulp == 0
        facts["k_close"] &= ulp == 0 or _close(got[0], want[0, :, :n])
        if plain is not None:
            diff = (got[0].float() - plain.float()).abs()
            facts["plain_torch_max_abs"] = max(facts["plain_torch_max_abs"], float(diff.max()))
            facts["plain_torch_differ"] = max(facts["plain_torch_differ"],
                                              float((diff > 0).float().mean()))
        del got
    del want, plain
    if not facts["v_exact"]:
        return "V read back differs from the tensor edit's", facts
    if not facts["k_exact"] and (not rerotated or not facts["k_close"]):
        return f"K read back {facts['k_max_ulp']} bf16 steps from the tensor edit's", facts
    return "", facts


def path_failure(rep: Any, n: int, want: str) -> str:
    """Why a rewrite's report is not ``n`` items rewritten on the ``want`` path ("" if it is)."""
    if rep.ok != n:
        return f"{rep.ok}/{n} sequences rewritten"
    if getattr(rep, want, 0) != n:
        return (f"{want} path expected for all {n}: fused {getattr(rep, 'fused', '?')}, "
                f"tensor {getattr(rep, 'tensor', '?')} (path {getattr(rep, 'path', '?')!r})")
    return ""


class W3FRun:
    """W3F's reps in a worker (see the module docstring).

    Each rep runs the three rewrites and the memcpy timed (reversed on odd reps); each
    timed rep then runs the three rewrites again, untimed, under :class:`.helpers.
    PrivatePeak` (reading ``smaps_rollup`` walks the page tables of every mapping, the L1
    pool's too: tens of ms per read at W3's size, which would slow the timed runs).
    """

    def __init__(self, w: Worker, d: Driven, variant: Variant) -> None:
        from lmcache_kv_fast import edits

        s = self.s = w.s
        self.w, self.d = w, d
        wl = workload_of(d.name)
        rng = random.Random(w.spec.get("seed", 0))  # W3's prompts
        self.prompts = [[rng.randrange(0, 100_000) for _ in range(s.w3_tokens)]
                        for _ in range(s.w3_sequences)]
        self.src = normal_kv(w.torch, wl.shape(s) if wl.shape else (),
                             w.spec.get("seed", 0) + 41)
        self.ctx = w.ctx(variant.server, w.spec["models"][wl.model])
        self.fns = dict(zip(d.records, edit_fns(s.w3_k), strict=True))
        self.plain_op, self.drop_op, self.rope_op = d.records
        w.info["W3F_plannable"] = {op: edits.plannable(fn) for op, fn in self.fns.items()}
        w.info["W3F_ctx_rewrites_rows"] = bool(getattr(self.ctx, "rewrites_rows", False))
        w.info["W3F_native_fused_rows"] = hasattr(w.native, "fused_rows")
        self.copy = memcpy_fn(w, self.src, s.w3_sequences)
        self.roof_path = roofline(variant.threads or w.spec["default_threads"])
        self.warmup = op_reps(d.name, s)[0]

    def seed(self, v: Variant, op: str) -> bool:
        """Clear L1 and store every prompt's KV again (a failure is recorded under ``op``)."""
        n = len(self.prompts)
        self.w.clear(v.server)  # each rewrite finds exactly the seeded sequences
        seeded = sum(bool(self.ctx.store(self.src, p)) for p in self.prompts)
        if seeded != n:
            self.w.record(v.path, op, self.s.w3_moved_bytes, None,
                          f"seeding stored {seeded}/{n} sequences (L1 too small?)")
        gc.collect()
        return seeded == n

    def rewrite(self, op: str) -> tuple[Any, float]:
        """``batch.rewrite`` of every prompt with ``op``'s edit: (report, seconds)."""
        from lmcache_kv_fast import batch

        t0 = time.perf_counter()
        rep = batch.rewrite(self.ctx, self.prompts, self.fns[op], progress=False)
        return rep, time.perf_counter() - t0

    def timed(self, v: Variant, op: str, i: int) -> None:
        """One timed rewrite of a rep (the first timed rep's fused ones read back)."""
        if not self.seed(v, op):
            return
        rep, dt = self.rewrite(op)
        bad = path_failure(rep, len(self.prompts), "tensor" if op == self.plain_op else "fused")
        if i < self.warmup:
            if bad:
                self.w.note(f"W3F warm-up, {op}: {bad}")
            return
        rec = self.w.record(v.path, op, self.s.w3_moved_bytes, None if bad else dt, bad,
                            rep=i - self.warmup, during=self.d.name)
        rec.setdefault("fused", []).append(getattr(rep, "fused", None))
        rec.setdefault("stage_seconds", []).append(dict(rep.stage_seconds))
        if i == self.warmup and op != self.plain_op and not bad:
            self.check(v, op)

    def memory(self, v: Variant, op: str) -> None:
        """One untimed rewrite under :class:`.helpers.PrivatePeak`; kept in ``op``'s record."""
        if not self.seed(v, op):
            return
        with PrivatePeak() as mem:
            rep, dt = self.rewrite(op)
        bad = path_failure(rep, len(self.prompts), "tensor" if op == self.plain_op else "fused")
        rec = self.w.records.get((v.path, op))
        if rec is None or bad:
            self.w.note(f"W3F memory run, {op}: {bad or 'no timed record'}")
            return
        rec["seq_bytes"] = self.s.w3_seq_bytes
        for key, val in (("private_growth", mem.growth), ("anon_growth", mem.anon_growth),
                         ("rss_anon_growth", mem.rss_anon_growth),
                         ("mem_samples", mem.samples), ("mem_read_s", mem.read_s),
                         ("mem_run_s", dt)):
            rec.setdefault(key, []).append(val)

    def check(self, v: Variant, op: str) -> None:
        """Read every fused rewrite back (:func:`verify`); a mismatch is a recorded failure."""
        reason, facts = verify(self.w, self.ctx, self.src, self.prompts, self.fns[op],
                               self.s.w3_k, op == self.rope_op)
        label = "drop" if op == self.drop_op else "drop+llama3"
        self.w.info[f"W3F_{label}_readback_exact"] = not reason and facts["k_exact"]
        self.w.info[f"W3F_{label}_readback"] = {**facts, "failure": reason}
        if reason:
            self.w.record(v.path, op, self.s.w3_moved_bytes, None, f"read-back: {reason}")
            self.w.note(f"W3F {op}: read-back: {reason}")

    def run_rep(self, v: Variant, i: int) -> None:
        """Rep ``i``: the timed rewrites and memcpy, then (timed reps) the memory runs."""
        contenders = [*self.d.records, W3F_COPY]
        for op in contenders if i % 2 == 0 else contenders[::-1]:
            if op != W3F_COPY:
                self.timed(v, op, i)
                continue
            dt = self.copy()
            if i >= self.warmup:
                self.w.record(self.roof_path, W3F_COPY, self.s.w3_input_bytes, dt,
                              rep=i - self.warmup, during=self.d.name)
        if i >= self.warmup:
            for op in self.d.records:
                self.memory(v, op)
        self.w.clear(v.server)


def fused_rewrite_state(w: Worker, d: Driven, variants: Sequence[Variant]) -> OpState:
    """W3F: the plain fn, the fused drop, the fused drop + llama3 and the memcpy, per rep."""
    if w.kind != "native" or w.native is None:
        raise Broken("W3F runs in this SDK's native worker only")
    run = W3FRun(w, d, variants[0])
    return OpState(d.name, [variants[0]], run.run_rep, w.s.w3_moved_bytes, run.warmup,
                   record=False)
