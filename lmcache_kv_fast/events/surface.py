"""What every KV-event subscription looks like to its user, over ZMQ or gRPC.

:class:`SubscriptionSurface` is the public half both subscriptions share: iteration with
the subscription's timeout, ``poll``, the state properties, the context manager and the
``repr``. A subscription provides ``_next(timeout)`` (the next batch or None) and
``close(timeout)``, and keeps ``_cursor``, ``_incarnation``, ``_closed``, ``_ended``,
``_timeout`` (and ``_error`` when it has one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lmcache_kv_fast.errors import InvalidArgumentError
from lmcache_kv_fast.events.stream_io import KVEventBatch, KVEventTimeout


class SubscriptionSurface:
    """The user-facing part of a KV-event subscription (a base class)."""

    model_name: str
    url: str
    instance_id: int
    _cursor: int
    _incarnation: int | None
    _closed: bool
    _ended: bool
    _timeout: float | None

    def _next(self, timeout: float | None) -> KVEventBatch | None:
        raise NotImplementedError

    def close(self, timeout: float = 1.0) -> None:
        """End the subscription and stop its threads (each subscription's own)."""
        raise NotImplementedError

    @property
    def cursor(self) -> int:
        """Resume point: ``next_cursor`` of the last batch returned (or the start cursor)."""
        return self._cursor

    @property
    def incarnation(self) -> int | None:
        """Server incarnation of the last batch returned."""
        return self._incarnation

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the subscription shut itself down)."""
        return self._closed

    @property
    def active(self) -> bool:
        """True while batches can still come (not closed, not ended by the server)."""
        return not self._closed and not self._ended and getattr(self, "_error", None) is None

    @property
    def timeout(self) -> float | None:
        """Seconds ``next()`` waits for a batch (None = forever)."""
        return self._timeout

    def __iter__(self) -> Iterator[KVEventBatch]:
        return self

    def __next__(self) -> KVEventBatch:
        batch = self._next(self._timeout)
        if batch is not None:
            return batch
        if self.active:
            raise KVEventTimeout(
                f"no KV event batch for {self.model_name!r} from {self.url} within "
                f"{self._timeout:g}s (the subscription stays open)"
            )
        raise StopIteration

    def poll(self, timeout: float | None = 0.0) -> KVEventBatch | None:
        """Return the next batch, or None after ``timeout`` seconds or once inactive.

        Args:
            timeout: Seconds to wait; None waits until a batch arrives or the stream ends.

        Raises:
            ProtocolError: The server sent a malformed batch (the subscription is closed).
        """
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgumentError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        return self._next(timeout)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close(timeout=0.2)

    def __repr__(self) -> str:
        state = "active" if self.active else "closed" if self._closed else "ended"
        return (f"{type(self).__name__}(model={self.model_name!r}, url={self.url!r}, "
                f"instance_id={self.instance_id}, cursor={self._cursor}, {state})")
