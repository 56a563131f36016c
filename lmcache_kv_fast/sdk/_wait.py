"""Waiting for an engine's asynchronous store to become visible, by lookups with back-off.

After a prefill the engine stores the prompt's whole chunks asynchronously, so the
stream's first read may come before they are on the server. Upstream 0.5.6 polls with a
full ``retrieve`` (lookup + prepare + copy of the whole prefix) every 0.2 s and takes the
first non-empty answer, which can be a partial prefix of a store still landing. Here the
stream reads the expected prefix once (``LMCacheRequestStream.read_cached``: usually the
store landed long ago and that read is all); when it finds less, a lookup (no data
moved) is repeated with a doubling delay (2 ms up to ``poll_interval``) until the prefix
the engine is expected to store is there, and the data is read again.

The expected prefix is the whole chunks of the prompt the engine computed last (a
vLLM LMCache connector stores complete prompt chunks only). If fewer chunks appear and
their count stops changing for ``settle`` seconds (the engine stored less: a full L1, a
connector that does not store), the wait ends with what is there; ``timeout`` bounds
it in every case.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["FIRST_DELAY_S", "WaitResult", "settle_time", "wait_for_prefix"]

#: First delay between two lookups (doubled up to ``poll_interval``).
FIRST_DELAY_S = 0.002


def settle_time(poll_interval: float) -> float:
    """Seconds an unchanged, partial lookup result is trusted as final."""
    return max(1.0, 5.0 * poll_interval)


@dataclass(frozen=True)
class WaitResult:
    """What a wait found.

    Attributes:
        hit_tokens: Cached prefix (whole chunks) at the end of the wait.
        target_tokens: The prefix that was waited for.
        lookups: Lookups sent.
        seconds: Time spent waiting.
        reason: ``"complete"``, ``"settled"`` (fewer chunks, unchanged for the settle
            time) or ``"timeout"``.
    """

    hit_tokens: int
    target_tokens: int
    lookups: int
    seconds: float
    reason: str


def wait_for_prefix(ctx: Any, tokens: Sequence[int], cache_salt: str, target_tokens: int,
                    timeout: float, poll_interval: float) -> WaitResult:
    """Look ``tokens`` up until ``target_tokens`` of them are cached (or the wait ends).

    Args:
        ctx: A context with ``lookup(tokens, cache_salt)`` and ``chunk_size``.
        tokens: The stream's tokens.
        cache_salt: Its salt.
        target_tokens: Tokens expected (rounded down to whole chunks here).
        timeout: Longest wait in seconds.
        poll_interval: Longest delay between two lookups.

    Returns:
        A :class:`WaitResult`; ``hit_tokens`` may be below the target (``settled`` or
        ``timeout``) or 0 (nothing cached).
    """
    chunk = ctx.chunk_size
    target = min(len(tokens), max(0, target_tokens)) // chunk * chunk
    t0 = time.monotonic()
    deadline = t0 + max(0.0, timeout)
    settle = settle_time(poll_interval)
    delay, lookups, last, last_change = FIRST_DELAY_S, 0, -1, t0
    probe = list(tokens[:target])
    while True:
        hit = ctx.lookup(probe, cache_salt) if target else 0
        lookups += 1
        now = time.monotonic()
        if hit != last:
            last, last_change = hit, now
        if hit >= target:
            return WaitResult(hit, target, lookups, now - t0, "complete")
        if hit > 0 and now - last_change >= settle:
            logger.info("engine store settled at %d of %d tokens after %.2fs", hit, target,
                        now - t0)
            return WaitResult(hit, target, lookups, now - t0, "settled")
        if now >= deadline:
            return WaitResult(hit, target, lookups, now - t0, "timeout")
        time.sleep(min(delay, max(0.0, deadline - now)))
        delay = min(delay * 2, max(poll_interval, FIRST_DELAY_S))
