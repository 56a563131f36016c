"""What a worker does in each driven op: one builder per ``Driven.action``.

A builder prepares an op (seeds what it reads, allocates buffers; nothing timed) and
returns its :class:`OpState`, whose ``fn(variant, rep)`` times one rep of one variant.
:data:`BUILDERS` maps the actions of :mod:`.workloads` to them; a new kind of workload op
adds its builder there.

Runs inside the worker interpreters (see :mod:`.worker`): standard library only at import.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .edits import (
    EDITS,
    LLAMA32_1B_ROPE,
    drop_every_kth,
    drop_every_kth_plain,
    llama3_inv_freq,
    plain_loop,
    snapkv_rerotate_plain,
    w7_queries,
)
from .helpers import malloc_trim, same_bytes
from .names import UPSTREAM, W3P
from .sizes import GiB
from .workloads import Driven, Variant, op_reps, workload_of

#: The worker of :mod:`.worker` (it imports this module, so it is not imported here: the
#: handlers use its ``spec``, ``s``, ``ctx``, ``src``, ``tokens``, ``clear`` and ``record``).
Worker = Any


class Broken(Exception):
    """A path failed for good in this op: skip its remaining reps."""


@dataclass
class OpState:
    """The op a worker is in: its live variants and how to time one rep of one."""

    op: str
    live: list[Variant]
    fn: Callable[[Variant, int], float | None]
    nbytes: int
    warmup: int
    record: bool = True
    end: Callable[[], None] | None = None


# ---------------------------------------------------------------------------- store / retrieve
def transfer_state(w: Worker, d: Driven, variants: Sequence[Variant]) -> OpState:
    """A store or retrieve op of the workload's tensor, with its roofline copy."""
    wl = workload_of(d.name)
    model = w.spec["models"][wl.model]
    src = w.src(wl.name)
    nb = src.numel() * src.element_size()
    warmup, _reps = op_reps(d.name, w.s)
    roof, roof_end = _roof_fn(w, d, src, any(v.roofline for v in variants))
    store = d.action == "store"
    sdk = _store_fn(w, d, model, src) if store else _retrieve_fn(w, d, model, src, variants)

    def fn(v: Variant, _i: int) -> float | None:
        return roof() if v.roofline else sdk(v)

    return OpState(d.name, list(variants), fn, nb, warmup, end=roof_end)


def _store_fn(w: Worker, d: Driven, model: str, src: Any) -> Callable[[Variant], float | None]:
    tokens = src.shape[-2]
    cold = d.cold
    # W2 keeps up to this many chunks per server (x 3 workers < the 0.8 watermark)
    per_clear = {srv: max(1, min(64, int(0.2 * w.spec[srv]["l1_gib"] * GiB /
                                         (src.numel() * src.element_size()))))
                 for srv in ("shm", "pickle") if w.spec.get(srv)}

    def store(v: Variant) -> float | None:
        if d.clear_each or w.since_clear.get(v.server, 0) >= per_clear[v.server]:
            w.clear(v.server)
        w.since_clear[v.server] = w.since_clear.get(v.server, 0) + 1
        if cold and not w.punch():
            raise Broken("fallocate(PUNCH_HOLE) on the L1 pool segment failed (or the "
                         "segment is not on this machine): cold stores not measured")
        ctx, toks = w.ctx(v.server, model), w.tokens(tokens)
        t0 = time.perf_counter()
        ok = ctx.store(src, toks)
        dt = time.perf_counter() - t0
        w.take_phases(ctx)
        return dt if ok else None

    return store


def _retrieve_fn(w: Worker, d: Driven, model: str, src: Any, variants: Sequence[Variant]
                 ) -> Callable[[Variant], float | None]:
    torch = w.torch
    tokens = src.shape[-2]
    seeded: dict[str, list[int]] = {}
    for srv in sorted({v.server for v in variants if not v.roofline}):
        ctx, toks = w.ctx(srv, model), w.tokens(tokens)
        if not ctx.store(src, toks):
            raise Broken(f"seeding {d.name} on the {srv} server failed (L1 too small?)")
        check = f"{workload_of(d.name).name}_{srv}_readback_exact"
        if check not in w.info:
            back = ctx.retrieve(toks)
            w.info[check] = back is not None and same_bytes(back, src)
            del back
        seeded[srv] = toks
    cold, out = d.cold, None
    if d.out:
        out = torch.zeros_like(src)

    def retrieve(v: Variant) -> float | None:
        if cold:
            gc.collect()
            malloc_trim()
            if w.native is not None:
                w.native.result_pool_trim()
        ctx = w.ctx(v.server, model)
        t0 = time.perf_counter()
        r = ctx.retrieve(seeded[v.server]) if out is None or v.path == UPSTREAM else \
            ctx.retrieve(seeded[v.server], out=out)
        dt = time.perf_counter() - t0
        w.take_phases(ctx)
        ok = r is not None and r.shape[-2] == tokens
        del r
        return dt if ok else None

    return retrieve


def _roof_fn(w: Worker, d: Driven, src: Any, wanted: bool
             ) -> tuple[Callable[[], float], Callable[[], None] | None]:
    """A flat memcpy of ``src``'s bytes, timed.

    Into a pre-faulted buffer (warm), into fresh anonymous memory advised MADV_HUGEPAGE
    like this SDK's result buffers (a cold retrieve's ``W1 copy cold``), or into fresh
    pages of a new /dev/shm file like a cold L1 (a cold store's ``W1 copy cold shm``).
    """
    if not wanted:
        return (lambda: 0.0), None
    torch, nat = w.torch, w.native
    n = src.numel() * src.element_size()
    cold = "" if not d.cold else "shm" if d.action == "store" else "anon"
    dst = None if cold else torch.zeros(n, dtype=torch.uint8)
    seg = f"lmckvf-roof-{os.getpid()}"

    def copy() -> float:
        keep: Any = dst
        if cold == "anon":
            keep = nat.ResultBuffer(n, prefault="none", pool=False)
            addr = keep.address
        elif cold == "shm":
            fd = os.open(f"/dev/shm/{seg}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, n)
            finally:
                os.close(fd)
            keep = nat.Mapping(seg, n, populate="none")
            addr = keep.address
        else:
            addr = dst.data_ptr()  # type: ignore[union-attr]
        t0 = time.perf_counter()
        nat.memcpy(addr, src.data_ptr(), n)
        dt = time.perf_counter() - t0
        if cold == "shm":
            keep.close()
            os.unlink(f"/dev/shm/{seg}")
        del keep
        return dt

    def end() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{seg}")

    return copy, end


# ---------------------------------------------------------------------------- rewrite (W3)
def _sequential_loop(ctx: Any, prompts: Sequence[Sequence[int]],
                     fn: Callable[[Any, Sequence[int]], tuple[Any, list[int]]],
                     stages: dict[str, float]) -> Callable[[], int]:
    """W3's baseline: retrieve, edit and store each prompt in turn; returns sequences stored.

    Each stage's seconds are added into ``stages`` (the caller clears it per rep).
    """
    def sequential() -> int:
        return plain_loop(ctx, prompts, fn, stages)

    return sequential


def rewrite_state(w: Worker, d: Driven, variants: Sequence[Variant]) -> OpState:
    """W3 / W3P: ``batch.rewrite`` vs a sequential retrieve / edit / store loop, both per rep.

    W3's edit is ``--w3-edit`` (into ``alloc`` under ``rewrite`` unless ``--w3-no-alloc``);
    W3P's is the issue's plain function (:func:`.edits.drop_every_kth_plain`) everywhere.
    """
    variant = variants[0]
    s = w.s
    wl = workload_of(d.name)
    rng = random.Random(w.spec.get("seed", 0))
    prompts = [[rng.randrange(0, 100_000) for _ in range(s.w3_tokens)]
               for _ in range(s.w3_sequences)]
    src = w.src(wl.name)
    model = w.spec["models"][wl.model]
    ctx = w.ctx(variant.server, model)
    plain = wl.name == W3P
    edit: Callable[..., tuple[Any, list[int]]] = drop_every_kth_plain if plain else \
        EDITS.get(w.spec.get("w3_edit"), drop_every_kth)  # type: ignore[arg-type]
    seq_op, batch_op = d.records
    stages: dict[str, float] = {}

    use_alloc = not plain and not w.spec.get("w3_no_alloc")

    def fn(kv: Any, toks: Sequence[int]) -> tuple[Any, list[int]]:
        return edit(kv, toks, s.w3_k)

    def fn_alloc(kv: Any, toks: Sequence[int], *, alloc: Callable[..., Any]
                 ) -> tuple[Any, list[int]]:
        return edit(kv, toks, s.w3_k, alloc=alloc)

    sequential = _sequential_loop(ctx, prompts, fn, stages)

    def batched() -> int:
        from lmcache_kv_fast import batch

        rep = batch.rewrite(ctx, prompts, fn_alloc if use_alloc else fn, progress=False)
        stages.update(rep.stage_seconds)
        return rep.ok

    contenders: list[tuple[str, Callable[[], int]]] = [(seq_op, sequential)]
    if w.kind == "native":
        contenders.append((batch_op, batched))

    warmup = op_reps(d.name, s)[0]

    def run_rep(v: Variant, i: int) -> None:
        # The warm-up rep faults in the L1 pages every contender then reuses.
        order = contenders if i % 2 == 0 else contenders[::-1]
        for op, run in order:
            w.clear(v.server)  # each contender finds exactly the seeded sequences
            seeded = sum(bool(ctx.store(src, p)) for p in prompts)
            if seeded != len(prompts):
                w.record(v.path, op, s.w3_moved_bytes, None,
                         f"seeding stored {seeded}/{len(prompts)} sequences (L1 too small?)")
                continue
            gc.collect()
            stages.clear()
            t0 = time.perf_counter()
            ok = run()
            dt = time.perf_counter() - t0
            if i < warmup:
                continue
            good = ok == len(prompts)
            rec = w.record(v.path, op, s.w3_moved_bytes, dt if good else None,
                           "" if good else f"{ok}/{len(prompts)} sequences rewritten",
                           rep=i - warmup, during=d.name)
            rec.setdefault("stage_seconds", []).append(dict(stages))
        w.clear(v.server)

    return OpState(d.name, [variant], run_rep, s.w3_moved_bytes, warmup, record=False)


# ---------------------------------------------------------------------------- W7
def _library_snapkv(s: Any, queries: Any) -> Any:
    """W7's library edit: ``edits.snapkv`` with Llama-3.2-1B's RoPE (this SDK's worker)."""
    from lmcache_kv_fast import edits

    cfg = {"model_type": "llama", "head_dim": LLAMA32_1B_ROPE["head_dim"],
           "rope_theta": LLAMA32_1B_ROPE["rope_theta"],
           "rope_scaling": {"rope_type": "llama3", **{k: v for k, v in LLAMA32_1B_ROPE.items()
                                                      if k not in ("head_dim", "rope_theta")}}}
    return edits.snapkv(queries, s.w7_window, 7, ratio=s.w7_ratio,
                        rope=edits.rope_from_config(cfg))


def _normal_kv(w: Worker, s: Any) -> Any:
    """W7's KV: standard normal bf16, fixed seed (the scores' matmuls on ``random_kv``'s
    bit patterns would run on denormals, tens of times slower than on real keys)."""
    torch = w.torch
    gen = torch.Generator().manual_seed(w.spec.get("seed", 0) + 35)
    shape = (2, s.w7_layers, s.w7_tokens, s.w7_kv_heads * s.w7_head_dim)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def _edit_thread(threads: int) -> Any:
    """One thread that runs edits as ``batch.rewrite``'s edit thread does.

    Its own intra-op thread count (``set_thread_intraop_threads``) and ``PooledOutputs``
    around each call. (On the project's loaded 2-core box the same edit on the main
    thread at 2 intra-op threads took 3-10x longer than on such a thread.)
    """
    from concurrent.futures import ThreadPoolExecutor

    from lmcache_kv_fast.batch._policy import set_thread_intraop_threads

    return ThreadPoolExecutor(1, thread_name_prefix="w7-edit",
                              initializer=set_thread_intraop_threads, initargs=(threads,))


def _timed_edit(edit: Any, kv: Any, prompt: list[int]) -> float:
    """Seconds of ``edit(kv, prompt)`` inside ``PooledOutputs`` (on the edit thread)."""
    from lmcache_kv_fast.batch._policy import PooledOutputs
    from lmcache_kv_fast.copy.select import backend

    with PooledOutputs(backend().alloc_result):
        t0 = time.perf_counter()
        out = edit(kv, prompt)
        dt = time.perf_counter() - t0
    del out
    return dt


def _one_sequence(ctx: Any, prompt: list[int], edit: Any, pool: Any) -> tuple[float, float]:
    """(retrieve s, edit s) of one sequence."""
    t0 = time.perf_counter()
    kv = ctx.retrieve(prompt)
    t1 = time.perf_counter()
    if kv is None:
        raise Broken("W7: a seeded sequence was not found")
    return t1 - t0, pool.submit(_timed_edit, edit, kv, prompt).result()


def edit_rewrite_state(w: Worker, d: Driven, variants: Sequence[Variant]) -> OpState:
    """W7: SnapKV + re-rotation of ``--w7-sequences`` sequences, per rep.

    This SDK's worker: ``batch.rewrite`` with the library edit, then each sequence's
    retrieve and the library edit on it alone, on a thread set up like rewrite's edit
    thread (one sample each per sequence); upstream's
    worker: its loop (retrieve, :func:`.edits.snapkv_rerotate_plain`, store).
    """
    variant, s = variants[0], w.s
    rng = random.Random(w.spec.get("seed", 0) + 7)
    prompts = [[rng.randrange(0, 100_000) for _ in range(s.w7_tokens)]
               for _ in range(s.w7_sequences)]
    src = _normal_kv(w, s)
    ctx = w.ctx(variant.server, w.spec["models"]["w7"])
    queries = w7_queries(s.w7_layers, s.w7_window)
    loop_op, batch_op, ret_op, edit_op = d.records
    warmup = op_reps(d.name, s)[0]
    native = w.kind == "native"
    edit = _library_snapkv(s, queries) if native else None
    pool = _edit_thread(w.torch.get_num_threads()) if native else None
    inv_freq = llama3_inv_freq(LLAMA32_1B_ROPE)

    def plain(kv: Any, toks: Sequence[int]) -> tuple[Any, list[int]]:
        return snapkv_rerotate_plain(kv, toks, queries, inv_freq, window=s.w7_window,
                                     ratio=s.w7_ratio, head_dim=s.w7_head_dim)

    def loop() -> int:
        return sum(bool((kv := ctx.retrieve(p)) is not None and ctx.store(*plain(kv, p)))
                   for p in prompts)

    def batched() -> int:
        from lmcache_kv_fast import batch

        return batch.rewrite(ctx, prompts, edit, progress=False).ok

    def seed(v: Variant, op: str) -> bool:
        w.clear(v.server)
        seeded = sum(bool(ctx.store(src, p)) for p in prompts)
        if seeded != len(prompts):
            w.record(v.path, op, s.w7_moved_bytes, None,
                     f"seeding stored {seeded}/{len(prompts)} sequences (L1 too small?)")
        gc.collect()
        return seeded == len(prompts)

    def run_rep(v: Variant, i: int) -> None:
        op, run = (batch_op, batched) if native else (loop_op, loop)
        if seed(v, op):
            t0 = time.perf_counter()
            ok = run()
            dt = time.perf_counter() - t0
            if i >= warmup:
                good = ok == len(prompts)
                w.record(v.path, op, s.w7_moved_bytes, dt if good else None,
                         "" if good else f"{ok}/{len(prompts)} sequences rewritten",
                         rep=i - warmup, during=d.name)
        if native and seed(v, ret_op):
            for p in prompts:
                r, e = _one_sequence(ctx, p, edit, pool)
                if i >= warmup:
                    w.record(v.path, ret_op, s.w7_seq_bytes, r, rep=i - warmup, during=d.name)
                    w.record(v.path, edit_op, s.w7_seq_bytes, e, rep=i - warmup,
                             during=d.name)
        w.clear(v.server)

    def end() -> None:
        if pool is not None:
            pool.shutdown()

    return OpState(d.name, [variant], run_rep, s.w7_moved_bytes, warmup, record=False,
                   end=end)


def fused_rewrite_state(w: Worker, d: Driven, variants: Sequence[Variant]) -> OpState:
    """W3F: :func:`.w3f.fused_rewrite_state` (imported here: :mod:`.w3f` imports this module)."""
    from .w3f import fused_rewrite_state as build

    return build(w, d, variants)


#: The builder of each ``Driven.action``.
BUILDERS: dict[str, Callable[[Worker, Driven, Sequence[Variant]], OpState]] = {
    "store": transfer_state,
    "retrieve": transfer_state,
    "rewrite": rewrite_state,
    "edit_rewrite": edit_rewrite_state,
    "fused_rewrite": fused_rewrite_state,
}
