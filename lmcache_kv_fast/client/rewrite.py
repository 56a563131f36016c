"""Rewrite in one pass: an edit's planned rows go from the read slots into the new ones.

``lookup`` → ``prepare_retrieve`` (the prefix read-locked, ``client/retrieve.py``) → the
caller's planner turns the hit's tokens into a plan (source row per output row, K's
rotation, the new tokens) → ``prepare_store`` of the new tokens → the core's ``fused_rows``
moves every kept row once from a read slot into a reserved one, K re-rotated on the way →
``commit_store`` (awaited) → ``commit_retrieve`` (deferred) and the sessions' ends. The
store is the store flow's (``client/store.py``: reservation age, late replies, settle
re-lookups), fed by :class:`FusedRows` instead of a tensor. The KV never exists as a
tensor, except as the snapshot a late reservation needs or when the plan does not fit
the core (then the prefix is gathered and the plan applied to the tensor).

Per-token chunks move with the core's ``fused_rows``; a CPU engine's rows, where a
token's K and V are scattered over its block in the attention kernel's order, with
``fused_blocks`` and the block's element map (:meth:`CpuEngineKV.block_offsets`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lmcache_kv_fast.copy import Region
from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.transport.zmq_client import Channel

if TYPE_CHECKING:
    from lmcache_kv_fast.client.retrieve import RetrieveFlow
    from lmcache_kv_fast.client.session import Session
    from lmcache_kv_fast.client.store import StoreFlow


class EditError(KVCacheSDKError):
    """The planner or the tensor edit raised (``__cause__``): the edit's failure, not I/O."""


class RowPlanLike(Protocol):
    """What a planner returns (``edits.RowPlan``): the rows, K's rotation, the tokens."""

    index: torch.Tensor
    rotation: Any
    tokens: Any


#: ``planner(hit_tokens) -> plan``: the edit planned for the cached prefix's tokens.
Planner = Callable[[list[int]], RowPlanLike]
#: ``apply(kv, hit_tokens) -> (kv, tokens)``: the same edit on a tensor (the fallback).
TensorEdit = Callable[[torch.Tensor, list[int]], "tuple[torch.Tensor, Any]"]


@dataclass
class RowsRewritten:
    """What :meth:`RewriteFlow.rewrite` did.

    Attributes:
        hit_tokens: Tokens of the cached prefix that was read.
        tokens: The edit's tokens as a list of ints (what was stored, whole chunks of it).
        stored: The store's result.
        fused: True when the rows went slot to slot; False when the plan did not fit the
            core and the prefix was gathered into a tensor and edited there.
        stages: Seconds per stage (``retrieve``, ``fn``, ``store``) and ``copy``.
    """

    hit_tokens: int
    tokens: Any
    stored: StoreResult
    fused: bool
    stages: dict[str, float] = field(default_factory=dict)


class FusedRows:
    """The store's row source: ``fused_rows`` from the read regions into reserved ones."""

    def __init__(self, s: Session, sources: dict[int, list[Region]], plan: RowPlanLike,
                 hit: list[int], apply: TensorEdit) -> None:
        self._s, self._sources, self._plan = s, sources, plan
        self._hit, self._apply = hit, apply
        out = int(plan.index.numel())
        self.nbytes = out * s.geom.planes * s.geom.layers * s.layout.hidden_size * \
            s.geom.itemsize

    def write(self, rank: int, chunk_ids: list[int], regions: list[Region]) -> None:
        """Run the core's gather (+ rotation) into the shard's reserved ``regions``."""
        s, plan = self._s, self._plan
        src = self._sources.get(rank, self._sources[min(self._sources)])
        if s.engine_kv is None:
            s.backend.fused_rows(src, chunk_ids, regions, plan.index, s.geom, plan.rotation)
        else:
            s.backend.fused_blocks(src, chunk_ids, regions, plan.index, s.geom, s.engine_kv,
                                   plan.rotation)

    def materialize(self) -> torch.Tensor:
        """The edit's KV as a tensor: the prefix gathered, then the tensor edit applied."""
        return self._apply(gather_prefix(self._s, self._sources, len(self._hit)), self._hit)[0]


def token_list(tokens: Any) -> list[int]:
    """A plan's tokens as a list of ints (a tensor's ``tolist``; a list of ints as it is)."""
    if isinstance(tokens, torch.Tensor):
        return tokens.tolist()
    if type(tokens) is list and set(map(type, tokens)) <= {int}:
        return tokens
    return [int(t) for t in tokens]


def gather_prefix(s: Session, sources: dict[int, list[Region]], tokens: int) -> torch.Tensor:
    """The read prefix as a ``[P, L, T, D]`` tensor (every shard's columns)."""
    kv = s.alloc_result(tokens)
    n = tokens // s.chunk_size
    for r, regions in sources.items():
        s.copy(s.backend.gather, kv, range(n), regions, s.shard_cols[r])
    return kv


def fused_kernel(s: Session) -> str | None:
    """The core's kernel that rewrites this session's chunks, or None (no fused rewrite).

    ``fused_rows`` for per-token chunks, ``fused_blocks`` for a CPU engine's rows with one
    element map per block; neither on the inline plane.
    """
    if s.shm is None:
        return None
    if s.engine_kv is None:
        return "fused_rows" if hasattr(s.backend, "fused_rows") else None
    if hasattr(s.backend, "fused_blocks") and s.engine_kv.block_offset_lists() is not None:
        return "fused_blocks"
    return None


def fits_core(s: Session, plan: RowPlanLike) -> bool:
    """Whether the core takes ``plan`` here (else the tensor path, which may refuse it).

    The edits are defined on the per-token ``[2, L, T, D]`` KV: a single-plane (MLA)
    model goes to the tensor edit, which says so; so does a rotation whose heads are not
    the engine's.
    """
    rot = plan.rotation
    if rot is not None and s.dtype not in (torch.bfloat16, torch.float32):
        return False
    if s.engine_kv is not None:
        return rot is None or rot.head_dim == s.engine_kv.head_dim
    if s.geom.planes != 2:
        return False
    return rot is None or s.geom.width % rot.head_dim == 0


class RewriteFlow:
    """The fused rewrite of one session (SHM plane).

    Args:
        session: The session it runs on.
        retrieval: The session's retrieve flow (the read half).
        storing: The session's store flow (the write half).
    """

    def __init__(self, session: Session, retrieval: RetrieveFlow, storing: StoreFlow) -> None:
        self._s, self._read, self._write = session, retrieval, storing

    def rewrite(self, toks: list[int], salt: str, planner: Planner, apply: TensorEdit,
                rc: dict[str, Any] | None, t0: float, stages: dict[str, float]
                ) -> RowsRewritten | None:
        """Rewrite the cached prefix of validated whole-chunk ``toks``; None on a miss.

        ``stages`` gets each stage's seconds as it ends (after a failure, the stages that
        ended say where it failed).
        """

        def body(ch: Channel, hit: list[int], rid: str, n: int, commits: list[list[Any]],
                 key: tuple[str, int, int]) -> RowsRewritten | None:
            with self._read.reading(ch, hit, rid, salt, n, commits, key) as sources:
                if sources is None:  # a shard was not prepared (evicted meanwhile)
                    return None
                stages["retrieve"] = time.perf_counter() - t0
                return self._edit_and_store(ch, sources, hit, salt, planner, apply, key,
                                            stages)

        return self._read.with_prefix(toks, salt, rc, t0, "rewrite", body)

    def _edit_and_store(self, ch: Channel, sources: dict[int, list[Region]], hit: list[int],
                        salt: str, planner: Planner, apply: TensorEdit,
                        read_key: tuple[str, int, int], stages: dict[str, float]
                        ) -> RowsRewritten:
        """Plan the edit, then store its rows (fused, or from a tensor when it must)."""
        s = self._s
        t = time.perf_counter()
        try:
            plan = planner(hit)
            new = token_list(plan.tokens)
            fused = fits_core(s, plan)
            src: Any = FusedRows(s, sources, plan, hit, apply)
            if not fused:
                src = src.materialize()
        except Exception as err:
            raise EditError(f"the edit failed: {err!r}") from err
        stages["fn"] = time.perf_counter() - t
        t = time.perf_counter()
        copied = s.tls.copy_s
        stored = self._store(ch, src, new, hit, salt, read_key)
        stages["store"] = time.perf_counter() - t
        stages["copy"] = s.tls.copy_s - copied
        return RowsRewritten(len(hit), new, stored, fused, stages)

    def _store(self, ch: Channel, src: Any, new: Sequence[int], hit: list[int], salt: str,
               read_key: tuple[str, int, int]) -> StoreResult:
        """Store ``src`` (rows or a tensor) under the whole chunks of ``new``."""
        s = self._s
        n = len(new) // s.chunk_size
        if n == 0:
            return StoreResult(0, 0, 0, 0, 0)
        toks = list(new[: n * s.chunk_size])
        if (salt, len(toks), hash(tuple(toks))) == read_key:  # the lock the read holds
            if toks != hit:  # pragma: no cover - a hash collision
                raise KVCacheSDKError("rewrite: the edited tokens share the read's lock key")
            return StoreResult(n * s.chunk_size, n, 0, n, 0)  # kept as it is: cached
        if isinstance(src, torch.Tensor):
            src = src.narrow(2, 0, n * s.chunk_size)
        with s.same_key(salt, toks) as store_key:
            return self._write.store_locked(ch, src, toks, salt, n, store_key)
