"""The rewrite engine's fused path: a library edit's rows moved slot to slot.

When the edit is one the library can plan without reading the KV
(:func:`lmcache_kv_fast.edits.plannable`: positional selections, given ``rope`` or not,
and chains of them) and the context can (``ctx.rewrites_rows``: SHM plane, per-token
chunks), an item is one call of ``ctx.rewrite_rows`` on an I/O thread: its kept rows go
once from the read-locked slots into the new sequence's reserved slots, K re-rotated in
the same pass. Anything else runs retrieve -> fn -> store on tensors as before.

An engine with its own fetch and store (the sdk's batched ``modify``) takes the fused
path only through :class:`FusedHooks`: which library edit an item's rows are planned
with, the tokens to rewrite (after waiting for them), and what to record once done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_kv_fast.batch._report import ItemResult
from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.client.rewrite import EditError, RowsRewritten
from lmcache_kv_fast.edits import RowPlan, plannable, row_plan
from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.validation import normalize_tokens

__all__ = ["FusedHooks", "FusedPath"]


@dataclass(frozen=True)
class FusedHooks:
    """How an engine with its own fetch and store runs items on the fused path.

    Attributes:
        edit: ``edit(item, fn)``: the library edit to plan the item's rows with, or None
            for the engine's own fetch -> fn -> store.
        tokens: ``tokens(item)``: the tokens whose cached prefix is rewritten (it may wait
            for them; raising fails the item at ``retrieve``).
        done: ``done(item, rewritten)``: called after a rewrite that read something.
        expected: ``expected(item)``: the prefix the item should find cached, tried
            first without waiting; only when less of it is cached (nothing written yet)
            does ``tokens`` wait. None: ``tokens`` first.
    """

    edit: Callable[[Any, Callable[..., Any]], Callable[..., Any] | None]
    tokens: Callable[[Any], Sequence[int]]
    done: Callable[[Any, RowsRewritten], None]
    expected: Callable[[Any], Sequence[int]] | None = None


class _ShortHit(Exception):
    """The cached prefix is shorter than expected: nothing was written; wait, then retry."""


class FusedPath:
    """Which items of a rewrite engine take the fused path, and running one.

    Args:
        ctx: The engine's context.
        enabled: The engine's own conditions hold (default fetch and store, or ``hooks``).
        hooks: The custom engine's hooks (None: items are token sequences).
    """

    def __init__(self, ctx: LMCacheKVCacheContext, enabled: bool,
                 hooks: FusedHooks | None = None) -> None:
        self.ctx = ctx
        self.enabled = enabled and ctx.rewrites_rows
        self.hooks = hooks
        self._known: dict[int, tuple[Callable[..., Any], bool]] = {}

    def edit_for(self, item: Any, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """The library edit an item is rewritten with slot to slot, or None."""
        if not self.enabled:
            return None
        edit = fn if self.hooks is None else self.hooks.edit(item, fn)
        return edit if edit is not None and self.takes(edit) else None

    def takes(self, fn: Callable[..., Any]) -> bool:
        """Whether an item edited by ``fn`` is rewritten slot to slot."""
        if not self.enabled:
            return False
        hit = self._known.get(id(fn))
        if hit is None or hit[0] is not fn:
            if len(self._known) > 16:
                self._known.clear()
            hit = self._known[id(fn)] = (fn, plannable(fn))
        return hit[1]

    def run(self, item: Any, fn: Callable[..., Any], salt: str, res: ItemResult) -> str:
        """Rewrite one item; fill ``res``. Returns the stage that failed ("" when none).

        Raises:
            Exception: A server or I/O error (the caller accounts it at the returned
                stage of :meth:`failed_stage`).
        """
        try:
            done = self._rewrite(item, fn, salt, res)
        except EditError as err:
            res.fail("fn", err.__cause__ or err)
            return "fn"
        if done is None:
            res.status, res.stage, res.reason = "missed", "retrieve", "nothing cached"
            return "retrieve"
        if self.hooks is not None:
            self.hooks.done(item, done)
        per_token = _token_bytes(self.ctx)
        res.tokens, res.nbytes = done.hit_tokens, done.hit_tokens * per_token
        res.path = "fused" if done.fused else "tensor"
        r = done.stored
        if r.ok:
            res.tokens += r.tokens_stored
            res.nbytes += per_token * r.chunks_written * self.ctx.chunk_size
            res.value = list(done.tokens)
            return ""
        res.status, res.stage = "failed", "store"
        res.reason = (f"store incomplete: {r.chunks_written} written, "
                      f"{r.chunks_already_cached} already cached, {r.chunks_refused} refused "
                      f"of {r.chunks_total} chunks" if r.chunks_total else
                      "fewer tokens than one chunk")
        return "store"

    def _rewrite(self, item: Any, fn: Callable[..., Any], salt: str,
                 res: ItemResult) -> RowsRewritten | None:
        """``ctx.rewrite_rows`` of the item: the expected prefix first, waiting only if short."""
        hooks = self.hooks
        want = [] if hooks is None or hooks.expected is None else hooks.expected(item)
        if want:
            want = normalize_tokens(want)
            try:
                done = self.ctx.rewrite_rows(want, _planner(fn, len(want)), fn, salt,
                                             stages=res.stages)
            except EditError as err:
                if not isinstance(err.__cause__, _ShortHit):
                    raise
            else:
                if done is not None:
                    return done
            res.stages.clear()
        toks = normalize_tokens(item if hooks is None else hooks.tokens(item))
        return self.ctx.rewrite_rows(toks, _planner(fn), fn, salt, stages=res.stages)

    @staticmethod
    def failed_stage(res: ItemResult) -> str:
        """Where an exception of :meth:`run` happened, by the stages that had ended."""
        if "fn" in res.stages:
            return "store"
        return "fn" if "retrieve" in res.stages else "retrieve"


def _planner(fn: Callable[..., Any], need: int = 0) -> Callable[[Sequence[int]], RowPlan]:
    """``fn``'s row plan for a hit; a hit shorter than ``need`` tokens raises ``_ShortHit``."""

    def planner(hit: Sequence[int]) -> RowPlan:
        if len(hit) < need:
            raise _ShortHit
        plan = row_plan(fn, hit)
        if plan is None:  # plannable(fn) said it would be
            raise KVCacheSDKError(f"{fn!r} could not be planned")
        return plan

    return planner


def _token_bytes(ctx: LMCacheKVCacheContext) -> int:
    """KV bytes of one token (every plane and layer)."""
    n = 1
    for d in ctx.kv_shape(1):
        n *= d
    return n * ctx.dtype.itemsize
