"""The merged report of a fleet job, and the fleet-wide progress display."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_kv_fast.batch import BatchReport, ItemError

logger = logging.getLogger(__name__)


@dataclass
class FleetItemError(ItemError):
    """One failed or missed item of a fleet job, with the server it ran on.

    Attributes:
        server: Name of the server the item was routed to (None: routed nowhere, e.g.
            cached on no server).
        attempts: Times the item was sent to an actor.
    """

    server: str | None = None
    attempts: int = 0


@dataclass
class FleetReport(BatchReport):
    """What a fleet job did: the :class:`BatchReport` fields over the whole fleet, plus.

    Attributes:
        per_server: One :class:`BatchReport` per server name (items that ran there).
        routes: Item index → server name it ran on (None: routed nowhere).
        retried: Item attempts sent again after their actor or node was lost.
        deferred: Retries held back until a lost attempt's staged store slots expired.
        actors_lost: Actor losses seen (killed, crashed, node gone).
        actors_replaced: Actors started anew after a permanent loss (server still alive).
        servers_down: Server name → why it was given up (its items failed).
        routing_seconds: Wall time spent routing (lookups, index, user function).
    """

    per_server: dict[str, BatchReport] = field(default_factory=dict)
    routes: dict[int, str | None] = field(default_factory=dict)
    retried: int = 0
    deferred: int = 0
    actors_lost: int = 0
    actors_replaced: int = 0
    servers_down: dict[str, str] = field(default_factory=dict)
    routing_seconds: float = 0.0

    def add_outcome(self, server: str | None, index: int, status: str, stage: str, reason: str,
                    tokens: int, nbytes: int, stages: dict[str, float], attempts: int) -> None:
        """Account one finished item (fleet-wide and on its server)."""
        targets = [self]
        if server is not None:
            targets.append(self.per_server.setdefault(server, BatchReport()))
        self.routes[index] = server
        for rep in targets:
            rep.items += 1
            rep.tokens_moved += tokens
            rep.bytes_moved += nbytes
            for k, v in stages.items():
                rep.stage_seconds[k] += v
            if status == "ok":
                rep.ok += 1
                continue
            if status == "missed":
                rep.missed += 1
            else:
                rep.failed += 1
            rep.errors.append(FleetItemError(index, stage, reason, server, attempts)
                              if rep is self else ItemError(index, stage, reason))

    def summary(self) -> str:
        """The fleet-wide paragraph, then one line per server."""
        head = super().summary()
        extra = []
        if self.retried or self.actors_lost:
            extra.append(f"{self.actors_lost} actor(s) lost, {self.retried} retried"
                         f"{f', {self.deferred} deferred' if self.deferred else ''}"
                         f"{f', {self.actors_replaced} replaced' if self.actors_replaced else ''}")
        if self.servers_down:
            extra.append("down: " + ", ".join(f"{k} ({v})" for k, v in self.servers_down.items()))
        lines = [head + (f"; {'; '.join(extra)}" if extra else "")
                 + f"; routing {self.routing_seconds:.2f}s"]
        for name, rep in sorted(self.per_server.items()):
            lines.append(f"  {name}: {rep.ok}/{rep.items} ok, {rep.missed} missed, "
                         f"{rep.failed} failed, {rep.bytes_moved / 2**20:.1f} MiB in "
                         f"{rep.seconds:.2f}s ({rep.gbps:.2f} GB/s)")
        return "\n".join(lines)


class FleetProgress:
    """A progress bar over the whole fleet (tqdm if installed, else a log line every ~5 s)."""

    def __init__(self, total: int | None, desc: str, enabled: bool,
                 counts: Callable[[], dict[str, Any]]) -> None:
        self.enabled = enabled
        self._counts = counts
        self._bar: Any = None
        self._n = 0
        self._total = total
        self._desc = desc
        self._last = time.monotonic()
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="seq", leave=False)
            except ImportError:
                self._bar = None

    def update(self, n: int = 1) -> None:
        """``n`` more items finished."""
        self._n += n
        if not self.enabled or n == 0:
            return
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(n)
            if now - self._last > 0.5:
                self._last = now
                self._bar.set_postfix(self._counts(), refresh=False)
        elif now - self._last > 5.0:
            self._last = now
            logger.info("%s: %d/%s sequences %s", self._desc, self._n, self._total or "?",
                        self._counts())

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()
