"""What the batch functions share: the report, per-item results, progress and small helpers."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.errors import InvalidArgumentError

logger = logging.getLogger("lmcache_kv_fast.batch")

@dataclass
class ItemError:
    """One failed or missed item of a batch."""

    index: int
    stage: str
    reason: str


@dataclass
class BatchReport:
    """What a batch did.

    Attributes:
        items: Items processed.
        ok: Items fully done (retrieved / stored / rewritten).
        missed: Items with nothing cached to retrieve.
        failed: Items that failed (refused store, ``fn`` raised, server error).
        cancelled: Items not started because the batch was interrupted.
        not_attempted: Items not started because the server was found gone (after an
            item's failure, a liveness ping got no answer; the batch raised
            ``ServerUnavailableError`` with this report). Not counted in ``items``.
        not_attempted_indices: Their indices (in input order).
        tokens_moved: Tokens retrieved plus tokens stored.
        bytes_moved: KV bytes retrieved plus stored.
        seconds: Wall time of the batch.
        stage_seconds: Summed per-stage time over items: ``retrieve``, ``fn``, ``store``
            (each includes its RPCs and copies; ``copy`` is the copy share of both).
        errors: One :class:`ItemError` per missed/failed item.
        peak_in_flight: Most items alive at once.
        pooled_outputs: Outputs of ``fn`` served from the warm result pool
            (``rewrite(..., pool_outputs=True)``) instead of fresh memory.
        fused: Rewritten items whose rows went slot to slot (a library edit the core
            runs, ``docs/batch.md``).
        tensor: Rewritten items that ran retrieve -> fn -> store on tensors.
    """

    items: int = 0
    ok: int = 0
    missed: int = 0
    failed: int = 0
    cancelled: int = 0
    not_attempted: int = 0
    not_attempted_indices: list[int] = field(default_factory=list)
    tokens_moved: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    errors: list[ItemError] = field(default_factory=list)
    peak_in_flight: int = 0
    pooled_outputs: int = 0
    fused: int = 0
    tensor: int = 0

    @property
    def path(self) -> str:
        """How the rewrite ran: ``"fused"``, ``"tensor"``, ``"mixed"`` ("" for no rewrite)."""
        if self.fused and self.tensor:
            return "mixed"
        return "fused" if self.fused else "tensor" if self.tensor else ""

    @property
    def gbps(self) -> float:
        """KV gigabytes per second moved over the batch."""
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One human-readable paragraph."""
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(self.stage_seconds.items()))
        return (
            f"{self.items} items: {self.ok} ok, {self.missed} missed, {self.failed} failed"
            f"{f', {self.cancelled} cancelled' if self.cancelled else ''}"
            f"{f', {self.not_attempted} not attempted (server unavailable)' if self.not_attempted else ''}; "
            f"{self.tokens_moved} tokens, {self.bytes_moved / 2**20:.1f} MiB in "
            f"{self.seconds:.2f}s ({self.gbps:.2f} GB/s); stages: {stages}; "
            f"peak in flight {self.peak_in_flight}"
            + (f"; {self.pooled_outputs} edit outputs from the warm pool"
               if self.pooled_outputs else "")
            + (f"; path {self.path} ({self.fused} fused)" if self.path else "")
        )

    def _add(self, other: ItemResult) -> None:
        self.items += 1
        self.tokens_moved += other.tokens
        self.bytes_moved += other.nbytes
        for k, v in other.stages.items():
            self.stage_seconds[k] += v
        self.fused += other.path == "fused"
        self.tensor += other.path == "tensor"
        if other.status == "ok":
            self.ok += 1
        else:
            if other.status == "missed":
                self.missed += 1
            else:
                self.failed += 1
            self.errors.append(ItemError(other.index, other.stage, other.reason))


@dataclass
class ItemResult:
    """One item's outcome as a batch engine produces it (``value``: the stage's payload)."""

    index: int
    status: str = "ok"  # ok | missed | failed (engines also: cancelled | not_attempted)
    stage: str = ""
    reason: str = ""
    tokens: int = 0
    nbytes: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    value: Any = None
    #: How a rewrite ran: ``"fused"`` (rows slot to slot), ``"tensor"`` (retrieve -> fn ->
    #: store on tensors); ``""`` for other batch operations.
    path: str = ""
    #: The exception of a failure (``item_failed``), until the engine looked at it.
    error: BaseException | None = field(default=None, repr=False, compare=False)

    def fail(self, stage: str, err: BaseException) -> ItemResult:
        """Mark this item failed at ``stage`` with ``err`` as the reason; return it."""
        self.status, self.stage, self.reason = "failed", stage, f"{type(err).__name__}: {err}"
        self.error = err
        return self

    def add_store(self, kv: torch.Tensor, r: Any) -> None:
        """Add a store's tokens and bytes (``r``: its ``StoreResult``); mark it failed when incomplete."""
        if r.ok:
            self.tokens += r.tokens_stored
            per_token = nbytes(kv) // max(1, kv.shape[-2])
            self.nbytes += per_token * r.chunks_written * (r.tokens_stored // max(1, r.chunks_total))
        else:
            self.status, self.stage = "failed", "store"
            self.reason = (f"store incomplete: {r.chunks_written} written, "
                           f"{r.chunks_already_cached} already cached, {r.chunks_refused} refused "
                           f"of {r.chunks_total} chunks" if r.chunks_total else
                           "fewer tokens than one chunk")


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t`` (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()


def check_common(ctx: Any, max_in_flight: int) -> None:
    """Validate the arguments every batch function takes."""
    if not isinstance(ctx, LMCacheKVCacheContext):
        raise InvalidArgumentError(f"ctx must be an LMCacheKVCacheContext, got {type(ctx).__name__}")
    ctx._check_process()
    if type(max_in_flight) is not int or max_in_flight < 1:
        raise InvalidArgumentError(f"max_in_flight must be a positive int, got {max_in_flight!r}")



def length_of(x: Any) -> int | None:
    """``len(x)``, or None for an iterator."""
    try:
        return len(x)
    except TypeError:
        return None

