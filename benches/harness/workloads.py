"""The workloads: each one declares, in one place, its ops, reps, paths and targets.

A :class:`Workload` names the rows it adds to the table (``ops``, in table order), the ops
the orchestrator drives in lock-step (``driven``: what each op does in a worker, and the
roofline copy timed along), its warm-up and timed reps, which paths each worker runs in
each driven op (``plan``), the KV tensor it moves (``shape``, ``model``), which upstream
row each of its rows compares against (``refs``) and its targets (``targets``).
:data:`REGISTRY` lists them; the tables every other module uses (:data:`OP_ORDER`,
:data:`GLOBAL_OPS`, :data:`ROOF_OP`, :func:`op_reps`, :func:`worker_plan`) derive from it.

Adding a workload: its op names in :mod:`.names`; its sizes in :class:`~.sizes.Sizes`
(and :data:`~.sizes.QUICK`, and their flags in :mod:`.cli`); a :class:`Workload` entry
here (appended: the table, the driving order and the targets section follow the
registry); and, for a new kind of op, a builder in :data:`.worker_ops.BUILDERS` under
its ``Driven.action``.

Standard library only: the worker interpreters import this module too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .names import (
    IC_KVF,
    IC_UP,
    KVF_PICKLE,
    KVF_T1,
    KVF_TORCH,
    UPSTREAM,
    UPSTREAM_PICKLE,
    UPSTREAM_T1,
    W1_COPY_COLD,
    W1_COPY_COLD_SHM,
    W1_COPY_WARM,
    W1_RET_COLD,
    W1_RET_OUT,
    W1_RET_WARM,
    W1_STORE_COLD,
    W1_STORE_WARM,
    W2_COPY,
    W2_RET,
    W2_STORE,
    W3,
    W3_BATCH,
    W3_SEQ,
    W3F,
    W3F_COPY,
    W3F_DROP,
    W3F_PLAIN,
    W3F_ROPE,
    W3P,
    W3P_BATCH,
    W3P_SEQ,
    W4_COPY,
    W4_RET,
    W4_STORE,
    W7,
    W7_BATCH,
    W7_EDIT,
    W7_LOOP,
    W7_RET,
    kvf_native,
    roofline,
)
from .sizes import HIDDEN, Sizes

#: Placeholders a :class:`TargetSpec` path or detail may use: this SDK's native path at the
#: default copy threads, and the roofline at the default threads.
OURS, ROOF = "{ours}", "{roof}"


# ---------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class Variant:
    """One path as a worker runs it."""

    path: str
    server: str = "shm"
    threads: int | None = None
    torch1: bool = False
    roofline: bool = False


@dataclass(frozen=True)
class Driven:
    """One op the orchestrator drives: every worker in it runs its reps in lock-step.

    Attributes:
        name: The op (also the record's op, unless said otherwise below).
        action: What a worker does in it: the builder in :data:`.worker_ops.BUILDERS`
            (``store``, ``retrieve``, ``rewrite``, ``edit_rewrite``, ``fused_rewrite``).
        roof: The op the roofline copy timed along in its reps is recorded under (None:
            no roofline copy).
        cold: ``store``: into fresh L1 pages (punched first), its roofline copy into
            fresh pages of a new /dev/shm file; ``retrieve``: into fresh result memory, its
            roofline copy into fresh anonymous memory.
        out: ``retrieve`` into a preallocated ``out`` (upstream: its drop-in retrieve).
        clear_each: ``store``: clear L1 before every store (False: only when a
            per-server budget of stored tensors is used up, for many small stores).
        upstream_as: The op the upstream path's samples are recorded under (None: this op).
        ping: Time a no-op ``ping`` per server between the reps (this SDK's workers).
        records: The ops its reps record (a failed ``begin`` marks each failed); empty:
            the op itself.
    """

    name: str
    action: str
    roof: str | None = None
    cold: bool = False
    out: bool = False
    clear_each: bool = True
    upstream_as: str | None = None
    ping: bool = True
    records: tuple[str, ...] = ()


@dataclass(frozen=True)
class TargetSpec:
    """One target: how to measure it and what it must reach.

    Attributes:
        name: Its line in the targets section.
        measure: ``speed`` (how many times faster ``a`` is than ``b``: paired per rep
            when both ran in the same reps, else the ratio of medians), ``time`` (``a``'s
            time over ``b``'s, paired the same way), ``p50`` (``a``'s median over ``b``'s),
            ``growth`` (the largest private memory growth of ``a``'s runs over the bytes
            of one sequence, ``a``'s record's ``private_growth`` and ``seq_bytes``;
            ``rss_growth``: of its ``rss_anon_growth``),
            ``ic_total`` (this SDK's import+connect over upstream's) or ``ic_own`` (this
            SDK's import+connect beyond ``import torch``, seconds).
        a: (path, op) measured; the path may be :data:`OURS` or :data:`ROOF`.
        b: (path, op) it is compared with.
        cmp: ``>=`` or ``<=``; ``""``: reported, no verdict (``info``).
        threshold: The value to reach.
        detail: Shown in the JSON (placeholders as in ``a``), before the method.
        ceiling: Also compute the ceiling (server waits + a flat memcpy) of ``a``.
    """

    name: str
    measure: str
    a: tuple[str, str] = ("", "")
    b: tuple[str, str] = ("", "")
    cmp: str = ">="
    threshold: float = 0.0
    detail: str = ""
    ceiling: bool = False


@dataclass(frozen=True)
class PathGroups:
    """The variants one worker offers, by server (input of a workload's ``plan``)."""

    kind: str
    default_threads: int
    shm: list[Variant]
    pickle: list[Variant]
    roofs: list[Variant]


@dataclass(frozen=True)
class Workload:
    """One workload: see the module docstring."""

    name: str
    ops: tuple[str, ...] = ()
    driven: tuple[Driven, ...] = ()
    reps: Callable[[Sizes], tuple[int, int]] | None = None
    plan: Callable[[PathGroups], dict[str, list[Variant]]] | None = None
    shape: Callable[[Sizes], tuple[int, ...]] | None = None
    model: str = "w1"
    refs: Mapping[str, str] = field(default_factory=dict)
    targets: tuple[TargetSpec, ...] = ()


# ---------------------------------------------------------------------------- W1
def _w1_plan(g: PathGroups) -> dict[str, list[Variant]]:
    plan = {op: g.shm + g.roofs for op in (W1_STORE_WARM, W1_STORE_COLD, W1_RET_WARM,
                                           W1_RET_COLD)}
    # upstream has no `out`: in this op it times its drop-in retrieve again (recorded
    # as W1 retrieve warm), so "with out vs upstream" is paired rep by rep like the rest
    plan[W1_RET_OUT] = [g.shm[0]] if g.kind == "upstream" else g.shm + g.roofs
    return plan


W1_WORKLOAD = Workload(
    name="W1",
    ops=(W1_STORE_WARM, W1_STORE_COLD, W1_RET_WARM, W1_RET_COLD, W1_RET_OUT, W1_COPY_WARM,
         W1_COPY_COLD, W1_COPY_COLD_SHM),
    driven=(
        Driven(W1_STORE_WARM, "store", roof=W1_COPY_WARM),
        Driven(W1_STORE_COLD, "store", roof=W1_COPY_COLD_SHM, cold=True),
        Driven(W1_RET_WARM, "retrieve", roof=W1_COPY_WARM),
        Driven(W1_RET_COLD, "retrieve", roof=W1_COPY_COLD, cold=True),
        Driven(W1_RET_OUT, "retrieve", roof=W1_COPY_WARM, out=True, upstream_as=W1_RET_WARM),
    ),
    reps=lambda s: (s.warmup, s.reps),
    plan=_w1_plan,
    shape=lambda s: (2, s.w1_layers, s.w1_tokens, HIDDEN),
    refs={W1_RET_OUT: W1_RET_WARM},
    targets=(
        TargetSpec("W1 retrieve warm, drop-in (no out) vs upstream", "speed",
                   (OURS, W1_RET_WARM), (UPSTREAM, W1_RET_WARM), ">=", 3.0, OURS, ceiling=True),
        TargetSpec("W1 retrieve warm, with out vs upstream", "speed",
                   (OURS, W1_RET_OUT), (UPSTREAM, W1_RET_WARM), ">=", 5.0, OURS, ceiling=True),
        TargetSpec("W1 retrieve warm, with out vs roofline", "speed",
                   (OURS, W1_RET_OUT), (ROOF, W1_COPY_WARM), ">=", 0.8, f"{OURS} / {ROOF}",
                   ceiling=True),
        TargetSpec("W1 store warm vs roofline", "speed",
                   (OURS, W1_STORE_WARM), (ROOF, W1_COPY_WARM), ">=", 0.9, f"{OURS} / {ROOF}",
                   ceiling=True),
        TargetSpec("W1 store warm vs upstream", "speed",
                   (OURS, W1_STORE_WARM), (UPSTREAM, W1_STORE_WARM), ">=", 1.0, OURS,
                   ceiling=True),
        TargetSpec("W1 store cold vs upstream", "speed",
                   (OURS, W1_STORE_COLD), (UPSTREAM, W1_STORE_COLD), ">=", 1.5, OURS),
        TargetSpec("torch.set_num_threads(1): W1 store warm vs upstream", "speed",
                   (KVF_T1, W1_STORE_WARM), (UPSTREAM_T1, W1_STORE_WARM), ">=", 1.4,
                   ceiling=True),
        TargetSpec("torch.set_num_threads(1): W1 retrieve warm drop-in vs upstream", "speed",
                   (KVF_T1, W1_RET_WARM), (UPSTREAM_T1, W1_RET_WARM), ">=", 2.5, ceiling=True),
    ),
)

# ---------------------------------------------------------------------------- W2
W2_WORKLOAD = Workload(
    name="W2",
    ops=(W2_STORE, W2_RET, W2_COPY),
    driven=(
        Driven(W2_STORE, "store", roof=W2_COPY, clear_each=False),
        Driven(W2_RET, "retrieve", roof=W2_COPY),
    ),
    reps=lambda s: (s.w2_warmup, s.w2_ops),
    plan=lambda g: dict.fromkeys((W2_STORE, W2_RET), g.shm + g.pickle + g.roofs),
    shape=lambda s: (2, s.w2_layers, s.chunk, HIDDEN),
    model="w2",
    targets=(
        TargetSpec("W2 retrieve p50 / upstream p50", "p50", (OURS, W2_RET), (UPSTREAM, W2_RET),
                   "<=", 0.5, OURS, ceiling=True),
        TargetSpec("W2 store p50 / upstream p50", "p50", (OURS, W2_STORE),
                   (UPSTREAM, W2_STORE), "<=", 0.6, OURS, ceiling=True),
    ),
)


# ---------------------------------------------------------------------------- W3
def _w3_plan(g: PathGroups) -> dict[str, list[Variant]]:
    if g.kind == "native":
        n = g.default_threads
        return {W3: [Variant(kvf_native(n), threads=n)]}
    return {W3: [g.shm[0]]} if g.kind == "upstream" else {}


W3_WORKLOAD = Workload(
    name="W3",
    ops=(W3_SEQ, W3_BATCH),
    driven=(Driven(W3, "rewrite", ping=False, records=(W3_SEQ, W3_BATCH)),),
    reps=lambda s: (s.w3_warmup, s.w3_reps),
    plan=_w3_plan,
    shape=lambda s: (2, s.w1_layers, s.w3_tokens, HIDDEN),
    refs={W3_BATCH: W3_SEQ},
    targets=(
        TargetSpec("W3 batch.rewrite vs upstream sequential loop", "speed", (OURS, W3_BATCH),
                   (UPSTREAM, W3_SEQ), ">=", 3.0, OURS),
        TargetSpec("W3 batch.rewrite vs own sequential loop", "speed", (OURS, W3_BATCH),
                   (OURS, W3_SEQ), ">=", 1.5, OURS),
    ),
)

# ---------------------------------------------------------------------------- W3P
def _w3p_plan(g: PathGroups) -> dict[str, list[Variant]]:
    plan = _w3_plan(g)
    return {W3P: plan[W3]} if W3 in plan else {}


#: W3 with the plain edit users write (issue 24): ``batch.rewrite`` is given exactly
#: ``keep = [i for i in range(len(tokens)) if i % 10 != 9]; return kv.index_select(2,
#: torch.tensor(keep)), [tokens[i] for i in keep]`` (no ``alloc``), and so are this SDK's
#: loop and upstream's loop; paired per rep like W3, same sizes (``--w3-*``).
W3P_WORKLOAD = Workload(
    name="W3P",
    ops=(W3P_SEQ, W3P_BATCH),
    driven=(Driven(W3P, "rewrite", ping=False, records=(W3P_SEQ, W3P_BATCH)),),
    reps=lambda s: (s.w3_warmup, s.w3_reps),
    plan=_w3p_plan,
    shape=lambda s: (2, s.w1_layers, s.w3_tokens, HIDDEN),
    refs={W3P_BATCH: W3P_SEQ},
    targets=(
        TargetSpec("W3P plain fn: batch.rewrite vs upstream loop", "speed", (OURS, W3P_BATCH),
                   (UPSTREAM, W3P_SEQ), ">=", 3.0, OURS),
        TargetSpec("W3P plain fn: batch.rewrite vs own loop", "speed", (OURS, W3P_BATCH),
                   (OURS, W3P_SEQ), ">=", 1.5, OURS),
    ),
)

# ---------------------------------------------------------------------------- W3F
def _w3f_plan(g: PathGroups) -> dict[str, list[Variant]]:
    plan = _w3_plan(g)
    return {W3F: plan[W3]} if W3 in plan and g.kind == "native" else {}


#: The fused rewrite: ``batch.rewrite`` of W3's sequences (``--w3-*`` sizes, each
#: contender on freshly seeded sequences) with W3P's plain fn (the tensor path: retrieve ->
#: fn -> store), with ``edits.drop_every(k)`` and with ``edits.drop_every(k, rope=<llama3 of
#: a Llama-3-8B-style config>)`` (the fused path: each kept row once from the read slots
#: into the reserved store slots in the core, K re-rotated on the way), and a flat memcpy of
#: the batch's input bytes (one sequence's bytes between two pre-faulted buffers, once per
#: sequence, summed; recorded under the roofline path), all in the same reps. Only this
#: SDK's native worker runs it. Each timed rep repeats the rewrites untimed while a thread
#: samples the worker's private memory (``smaps_rollup``, every ~5 ms); the first timed rep
#: reads every fused rewrite back against the library's edit of the seeded KV on a tensor.
W3F_WORKLOAD = Workload(
    name="W3F",
    ops=(W3F_PLAIN, W3F_DROP, W3F_ROPE, W3F_COPY),
    driven=(Driven(W3F, "fused_rewrite", roof=W3F_COPY, ping=False,
                   records=(W3F_PLAIN, W3F_DROP, W3F_ROPE)),),
    reps=lambda s: (s.w3_warmup, s.w3_reps),
    plan=_w3f_plan,
    shape=lambda s: (2, s.w1_layers, s.w3_tokens, HIDDEN),
    targets=(
        TargetSpec("W3F fused drop vs plain fn (both batch.rewrite)", "speed", (OURS, W3F_DROP),
                   (OURS, W3F_PLAIN), ">=", 2.0, OURS),
        TargetSpec("W3F fused drop+llama3 vs plain fn (both batch.rewrite)", "speed",
                   (OURS, W3F_ROPE), (OURS, W3F_PLAIN), ">=", 1.5, OURS),
        TargetSpec("W3F fused drop time / flat memcpy of the input", "time", (OURS, W3F_DROP),
                   (ROOF, W3F_COPY), "<=", 3.0, f"{OURS} / {ROOF}"),
        TargetSpec("W3F fused drop+llama3 time / flat memcpy of the input", "time",
                   (OURS, W3F_ROPE), (ROOF, W3F_COPY), "", 0.0, f"{OURS} / {ROOF}"),
        TargetSpec("W3F fused drop: private growth / one sequence's KV", "growth",
                   (OURS, W3F_DROP), cmp="<=", threshold=0.5, detail=OURS),
        TargetSpec("W3F fused drop: anon RSS growth (statm, 1 ms) / one sequence", "rss_growth",
                   (OURS, W3F_DROP), cmp="", detail=OURS),
        TargetSpec("W3F fused drop+llama3: private growth / one sequence's KV", "growth",
                   (OURS, W3F_ROPE), cmp="", detail=OURS),
        TargetSpec("W3F plain fn: private growth / one sequence's KV", "growth",
                   (OURS, W3F_PLAIN), cmp="", detail=OURS),
    ),
)

# ---------------------------------------------------------------------------- W7
def _w7_plan(g: PathGroups) -> dict[str, list[Variant]]:
    plan = _w3_plan(g)
    return {W7: plan[W3]} if W3 in plan else {}


#: Rewrite with SnapKV + re-rotation (issue 35) at Llama-3.2-1B's KV geometry (16 layers x
#: 8 KV heads x 64, bf16): ``batch.rewrite`` with ``edits.snapkv(queries, rope=...)`` (the
#: queries random but fixed, given by the caller) against upstream's loop (retrieve, the
#: same edit in plain torch, store); also one sequence's retrieve and the library edit's
#: own time on it (inside ``PooledOutputs``, as ``rewrite`` runs it). ``--w7-*`` sizes.
W7_WORKLOAD = Workload(
    name="W7",
    ops=(W7_LOOP, W7_BATCH, W7_RET, W7_EDIT),
    driven=(Driven(W7, "edit_rewrite", ping=False, records=(W7_LOOP, W7_BATCH, W7_RET,
                                                            W7_EDIT)),),
    reps=lambda s: (s.w7_warmup, s.w7_reps),
    plan=_w7_plan,
    shape=lambda s: (2, s.w7_layers, s.w7_tokens, s.w7_kv_heads * s.w7_head_dim),
    model="w7",
    refs={W7_BATCH: W7_LOOP},
    targets=(
        TargetSpec("W7 SnapKV+rope: batch.rewrite vs upstream loop", "speed", (OURS, W7_BATCH),
                   (UPSTREAM, W7_LOOP), ">=", 3.0, OURS),
        TargetSpec("W7 SnapKV+rope: edit / retrieve of one sequence", "p50", (OURS, W7_EDIT),
                   (OURS, W7_RET), "<=", 1.0, OURS),
    ),
)

# ---------------------------------------------------------------------------- W4
W4_WORKLOAD = Workload(
    name="W4",
    ops=(W4_STORE, W4_RET, W4_COPY),
    driven=(Driven(W4_STORE, "store", roof=W4_COPY), Driven(W4_RET, "retrieve", roof=W4_COPY)),
    reps=lambda s: (s.warmup, s.w4_reps),
    plan=lambda g: dict.fromkeys((W4_STORE, W4_RET), g.pickle + g.roofs) if g.pickle else {},
    shape=lambda s: (2, s.w1_layers, s.w4_tokens, HIDDEN),
    targets=(
        TargetSpec("W4 pickle plane store vs upstream", "speed", (KVF_PICKLE, W4_STORE),
                   (UPSTREAM_PICKLE, W4_STORE), ">=", 2.0, ceiling=True),
        TargetSpec("W4 pickle plane retrieve vs upstream", "speed", (KVF_PICKLE, W4_RET),
                   (UPSTREAM_PICKLE, W4_RET), ">=", 2.0, ceiling=True),
    ),
)

# ---------------------------------------------------------------------------- IC
#: Import + connect in fresh interpreters (run by :mod:`.ic`, not by the workers).
IC_WORKLOAD = Workload(
    name="IC",
    targets=(
        TargetSpec("import+connect / upstream import+connect", "ic_total", (IC_KVF, ""),
                   (IC_UP, ""), "<=", 0.75, "medians"),
        TargetSpec("own import+connect beyond import torch (s)", "ic_own", (IC_KVF, ""),
                   cmp="<=", threshold=0.2, detail="in-process"),
    ),
)

# ---------------------------------------------------------------------------- W5
#: The engine loop against a real vLLM CPU engine (``bench --engine``): run by
#: :mod:`.engine_loop` in the orchestrator (an engine, not the workers), with its own table
#: (prefill / retrieve / edit / store / re-serve, the SDK's share, this SDK vs upstream).
W5_WORKLOAD = Workload(name="W5")
#: Workloads that need a real engine (only with ``--engine``; not in the default list).
ENGINE_WORKLOADS: tuple[str, ...] = ("W5",)
#: Workloads run only when named (``--workloads W7``): not in the default list.
OPTIONAL_WORKLOADS: tuple[str, ...] = ("W3F", "W7")

# ---------------------------------------------------------------------------- registry
#: Every workload, in table and driving order.
REGISTRY: tuple[Workload, ...] = (W1_WORKLOAD, W2_WORKLOAD, W3_WORKLOAD, W3P_WORKLOAD,
                                  W3F_WORKLOAD, W4_WORKLOAD, IC_WORKLOAD, W5_WORKLOAD,
                                  W7_WORKLOAD)
#: The order of the targets section (W3's targets have always come last); new ones append.
TARGET_ORDER: tuple[str, ...] = ("W1", "W2", "W4", "IC", "W3", "W3P", "W7", "W3F")

WORKLOADS = tuple(w.name for w in REGISTRY)
#: The table's rows, in order.
OP_ORDER = [op for w in REGISTRY for op in w.ops]
#: Ops the orchestrator drives, in order; roofline copies ride along as extra variants.
GLOBAL_OPS = [d.name for w in REGISTRY for d in w.driven]
#: The roofline copy timed within each op (recorded under this op name); an op whose reps
#: record several ops (``Driven.records``) maps each of them to it too.
ROOF_OP = {op: d.roof for w in REGISTRY for d in w.driven if d.roof is not None
           for op in (d.name, *d.records)}
#: The upstream op a row compares against, where not its own op.
UPSTREAM_OP = {k: v for w in REGISTRY for k, v in w.refs.items()}

_DRIVEN = {d.name: d for w in REGISTRY for d in w.driven}
_OWNER = {op: w for w in REGISTRY for op in (*w.ops, *(d.name for d in w.driven))}


def workload(name: str) -> Workload:
    """The registered workload called ``name``."""
    return next(w for w in REGISTRY if w.name == name)


def workload_of(op: str) -> Workload:
    """The workload a (driven or recorded) op belongs to."""
    return _OWNER[op]


def driven(op: str) -> Driven:
    """The driven op called ``op``."""
    return _DRIVEN[op]


def op_reps(op: str, s: Sizes) -> tuple[int, int]:
    """(warm-up reps, timed reps) of an op: the same for every worker."""
    reps = workload_of(op).reps
    assert reps is not None, op
    return reps(s)


def path_groups(spec: dict[str, Any]) -> PathGroups:
    """The variants the worker of ``spec`` offers, by server."""
    kind, n = spec["worker"], spec["default_threads"]
    has_pickle = spec.get("pickle") is not None
    if kind == "native":
        shm = [Variant(kvf_native(k), threads=k) for k in spec["threads"]]
        shm.append(Variant(KVF_T1, threads=n, torch1=True))
        pick = [Variant(KVF_PICKLE, "pickle", threads=n)] if has_pickle else []
        roofs = [Variant(roofline(k), threads=k, roofline=True) for k in sorted({1, n})]
    elif kind == "torch":
        shm, pick, roofs = [Variant(KVF_TORCH)], [], []
    else:
        shm = [Variant(UPSTREAM), Variant(UPSTREAM_T1, torch1=True)]
        pick = [Variant(UPSTREAM_PICKLE, "pickle")] if has_pickle else []
        roofs = []
    return PathGroups(kind, n, shm, pick, roofs)


def worker_plan(spec: dict[str, Any]) -> dict[str, list[Variant]]:
    """The variants a worker runs in each op it takes part in."""
    groups = path_groups(spec)
    plan: dict[str, list[Variant]] = {}
    for w in REGISTRY:
        if w.name in spec["workloads"] and w.plan is not None:
            plan.update(w.plan(groups))
    return plan


def recorded_op(op: str, v: Variant) -> str:
    """The op a variant's samples of driven ``op`` are recorded under."""
    if v.roofline:
        return ROOF_OP[op]
    d = _DRIVEN.get(op)
    if d is not None and d.upstream_as is not None and v.path == UPSTREAM:
        return d.upstream_as  # its drop-in call, the reference of the `out` paths
    return op
