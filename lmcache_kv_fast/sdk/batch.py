"""The batched stream: prefill → modify → decode over many request streams (0.5.6 names).

:class:`LMCacheBatchedStream` runs its streams' engine passes concurrently
(:meth:`~LMCacheBatchedStream.prefill`, :meth:`~LMCacheBatchedStream.decode`) and edits
their caches in a bounded pipeline (:meth:`~LMCacheBatchedStream.modify`, see
:mod:`lmcache_kv_fast.sdk._modify`); each phase returns a :class:`Metrics` report
(``.emit()`` prints the terminal table, ``.to_dict()`` gives the data), as in 0.5.6.

Differences from 0.5.6 (docs/sdk.md):

* engine passes run on at most ``max_concurrency`` threads (0.5.6: one per stream);
  streams that finished (``is_done``) are skipped;
* modify keeps at most ``max_in_flight`` streams' tensors in memory and waits for the
  engine's store with lookups (0.5.6: every stream's KV at once, full re-reads every
  0.2 s);
* every stream's failure is reported, in one :class:`LMCacheBatchedStreamError` raised
  after the whole phase ran (0.5.6 raises the first one); the phase's report is on the
  exception (``err.metrics``); a modify against a server that died stops after one
  failed stream and one unanswered ping with :class:`LMCacheBatchedStreamServerError`
  (both that and ``ServerUnavailableError``), every stream listed;
* reports aggregate TTFT and TPOT (mean, p50, p90), count only the selected streams, and
  the modify report says what was read, edited, stored and waited for;
* a progress bar on long phases (``progress=None``: on a terminal, from 8 streams);
* while the engine prefills, the buffers the next modify will read and edit into are
  mapped and faulted in the background (``prepare_modify``; :mod:`~.prepare`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_kv_fast.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
    ServerUnavailableError,
)
from lmcache_kv_fast.progress import Progress
from lmcache_kv_fast.sdk._modify import ModifyOutcome, default_max_in_flight, modify_streams
from lmcache_kv_fast.sdk._prepare import ModifyPreparation
from lmcache_kv_fast.sdk.context import ModifyFnType
from lmcache_kv_fast.sdk.metrics import Metrics, StreamHandler, get_formatter
from lmcache_kv_fast.sdk.request import LMCacheRequestStream, StreamPerfMetrics

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_CONCURRENCY",
    "LMCacheBatchedStream",
    "LMCacheBatchedStreamError",
    "LMCacheBatchedStreamServerError",
    "Metrics",
    "percentile",
]

#: Engine passes of a batch run at once, by default (0.5.6: one thread per stream).
DEFAULT_MAX_CONCURRENCY = 64
#: ``progress=None`` shows a bar from this many streams on (on a terminal).
AUTO_MIN_STREAMS = 8


def _want_progress(progress: bool | None, n: int) -> bool:
    """Whether to show progress for ``n`` streams (``None``: a terminal and enough streams)."""
    if progress is None:
        return n >= AUTO_MIN_STREAMS and bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


class LMCacheBatchedStreamError(KVCacheSDKError):
    """A batch operation failed for one or more streams.

    Attributes:
        errors: ``{stream_id: reason}`` for every stream that failed.
        metrics: The phase's report (the streams that succeeded), when there is one.
    """

    def __init__(self, message: str, errors: Mapping[str, str] | None = None,
                 metrics: Metrics | None = None) -> None:
        super().__init__(message)
        self.errors: dict[str, str] = dict(errors or {})
        self.metrics = metrics


class LMCacheBatchedStreamServerError(LMCacheBatchedStreamError, ServerUnavailableError):
    """A modify stopped because the server is gone (killed, frozen, unreachable).

    Both an :class:`LMCacheBatchedStreamError` (``errors`` lists every stream not
    modified: the ones in flight as failed, the rest ``not_attempted``; ``metrics`` is
    the phase's report) and a :class:`~lmcache_kv_fast.errors.ServerUnavailableError`
    (``report``: the rewrite engine's ``BatchReport`` of the group that stopped). Streams
    modified before are updated; the others are unchanged.
    """


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def _failure(what: str, errors: Mapping[str, str], metrics: Metrics | None
             ) -> LMCacheBatchedStreamError:
    lines = "\n".join(f"  {sid}: {reason}" for sid, reason in errors.items())
    return LMCacheBatchedStreamError(
        f"{what} failed for {len(errors)} stream(s):\n{lines}", errors, metrics)


class LMCacheBatchedStream:
    """Request streams run together as one batch.

    Args:
        max_concurrency: Engine passes at once (default ``min(streams, 64)``).
        max_in_flight: Streams whose tensors are between read and store at once during a
            modify (memory bound; default: the cores this process may run on, 2 to 4,
            ``sdk.modify.default_max_in_flight``).
        progress: Progress bar on long phases (None: on a terminal, from 8 streams).
        prepare_modify: During :meth:`prefill`, map and fault the result buffers the
            next modify will use, on a background thread joined before the prefill
            returns (``sdk/_prepare.py``; the memory the modify would take anyway).

    Attributes:
        request_streams: The member streams by id.
        perf_metrics: The latest pass's :class:`StreamPerfMetrics` per stream id.
        last_modify: What the latest modify did, per stream (a ``ModifyOutcome``).
    """

    def __init__(self, *, max_concurrency: int | None = None,
                 max_in_flight: int | None = None, progress: bool | None = None,
                 prepare_modify: bool = True) -> None:
        for name, v in (("max_concurrency", max_concurrency), ("max_in_flight", max_in_flight)):
            if v is not None and (type(v) is not int or v < 1):
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        self.request_streams: dict[str, LMCacheRequestStream] = {}
        self.perf_metrics: dict[str, StreamPerfMetrics] = {}
        self.last_modify: ModifyOutcome | None = None
        self.max_concurrency = max_concurrency
        self.max_in_flight = default_max_in_flight() if max_in_flight is None else max_in_flight
        self.progress = progress
        self.prepare_modify = bool(prepare_modify)
        self._skipped: list[str] = []

    # ------------------------------------------------------------------ membership
    def add(self, request_stream: LMCacheRequestStream) -> None:
        """Add a stream (keyed by its id).

        Raises:
            LMCacheBatchedStreamError: A stream with that id is in the batch.
        """
        if not isinstance(request_stream, LMCacheRequestStream):
            raise InvalidTypeError(
                f"request_stream must be an LMCacheRequestStream, got "
                f"{type(request_stream).__name__}")
        sid = request_stream.request_stream_id
        if sid in self.request_streams:
            raise LMCacheBatchedStreamError(f"RequestStream {sid} already exists.")
        self.request_streams[sid] = request_stream

    def get_request_stream(self, stream_id: str) -> LMCacheRequestStream:
        """The stream with ``stream_id``.

        Raises:
            LMCacheBatchedStreamError: No such stream.
        """
        if stream_id not in self.request_streams:
            raise LMCacheBatchedStreamError(f"RequestStream with id {stream_id} does not exist.")
        return self.request_streams[stream_id]

    def _select(self, stream_ids: Sequence[str] | None) -> list[str]:
        ids = list(self.request_streams) if stream_ids is None else list(stream_ids)
        unknown = [s for s in ids if s not in self.request_streams]
        if unknown:
            raise LMCacheBatchedStreamError(f"RequestStream {unknown[0]} does not exist."
                                            + (f" (and {len(unknown) - 1} more)"
                                               if len(unknown) > 1 else ""))
        return list(dict.fromkeys(ids))

    # ------------------------------------------------------------------ engine passes
    def run_request_streams(self, sampling_params: Mapping[str, Any],
                            stream_ids: list[str] | None = None) -> float:
        """One engine pass on every selected stream that is not done, concurrently.

        Records each stream's :class:`StreamPerfMetrics` in :attr:`perf_metrics`.

        Returns:
            Wall time of the pass in seconds (0.0 when there is nothing to run).

        Raises:
            LMCacheBatchedStreamError: A stream id is unknown, or streams failed (all of
                them are listed, after every stream ran).
        """
        duration, errors = self._run(sampling_params, stream_ids, "generate")
        if errors:
            raise _failure("generate", errors, None)
        return duration

    def _run(self, sampling_params: Mapping[str, Any], stream_ids: list[str] | None,
             desc: str) -> tuple[float, dict[str, str]]:
        ids = self._select(stream_ids)
        if not isinstance(sampling_params, Mapping):
            raise InvalidTypeError(
                f"sampling_params must be a mapping, got {type(sampling_params).__name__}")
        run = [s for s in ids if not self.request_streams[s].is_done]
        self._skipped = [s for s in ids if s not in run]
        if self._skipped:
            logger.info("%s: %d finished stream(s) skipped", desc, len(self._skipped))
        self.perf_metrics.clear()
        if not run:
            return 0.0, {}
        errors: dict[str, str] = {}
        workers = min(len(run), self.max_concurrency or DEFAULT_MAX_CONCURRENCY)
        bar = Progress(len(run), desc, _want_progress(self.progress, len(run)), unit="stream")
        t0 = time.perf_counter()
        prep = None
        if desc == "prefill" and self.prepare_modify:
            prep = ModifyPreparation([self.request_streams[s] for s in run],
                                     self.max_in_flight)
        with cf.ThreadPoolExecutor(max_workers=workers,
                                   thread_name_prefix="lmcache-sdk-stream") as pool:
            futures = {pool.submit(self.request_streams[s].generate, sampling_params): s
                       for s in run}
            try:
                for fut in cf.as_completed(futures):
                    sid = futures[fut]
                    try:
                        self.perf_metrics[sid] = fut.result()
                    except Exception as err:
                        errors[sid] = f"{type(err).__name__}: {err}"
                    bar.update()
            finally:
                bar.close()
                if prep is not None:
                    prep.join()
        return time.perf_counter() - t0, {s: errors[s] for s in run if s in errors}

    def get_perf_metrics(self, duration: float, fmt: str, width: int, mode: str,
                         stream_ids: list[str] | None = None) -> Metrics:
        """The report of the latest pass over the selected streams.

        Args:
            duration: Wall time of the pass (for throughputs).
            fmt: ``"terminal"`` or ``"json"`` (what :meth:`Metrics.emit` prints).
            width: Width of the terminal report.
            mode: ``"prefill"`` (input tokens, TTFT) or ``"decode"`` (output tokens,
                TPOT, TTFT).
            stream_ids: Streams to include (None: all).

        Raises:
            LMCacheBatchedStreamError: An unknown ``mode``.
        """
        if mode not in ("prefill", "decode"):
            raise LMCacheBatchedStreamError(f"Invalid mode {mode}.")
        ids = self._select(stream_ids)
        perf = [self.perf_metrics[s] for s in ids if s in self.perf_metrics]
        metrics = Metrics(title=f"Batched Stream Metrics ({mode})")
        metrics.add_handler(StreamHandler(get_formatter(fmt, width=width)))
        cfg = metrics.add_section("config", "Configuration")
        cfg.add("num_request_streams", "Number of Request Streams", len(ids))
        cfg.add("num_streams_run", "Streams Run", len(perf))
        cfg.add("num_streams_skipped", "Streams Skipped (done)",
                len([s for s in self._skipped if s in ids]))
        res = metrics.add_section("results", "Results")
        res.add("duration", "Total Duration (s)", duration)
        input_tokens = sum(p.input_tokens for p in perf)
        output_tokens = sum(p.output_tokens for p in perf)
        ttft = [p.ttft for p in perf if p.output_tokens]
        tpot = [g for p in perf for g in p.tpot]
        if mode == "prefill":
            res.add("input_tokens", "Total Input Tokens", input_tokens)
            res.add("input_tput", "Input Throughput (tokens/s)",
                    input_tokens / duration if duration > 0 else 0.0)
        else:
            res.add("output_tokens", "Total Output Tokens", output_tokens)
            res.add("output_tput", "Decode Throughput (tokens/s)",
                    output_tokens / duration if duration > 0 else 0.0)
        lat = metrics.add_section("latency", "Latency (ms)")
        lat.add("ttft_mean_ms", "Mean TTFT", _ms(sum(ttft) / len(ttft)) if ttft else None)
        lat.add("ttft_p50_ms", "P50 TTFT", _ms(percentile(ttft, 50)))
        lat.add("ttft_p90_ms", "P90 TTFT", _ms(percentile(ttft, 90)))
        if mode == "decode":
            lat.add("tpot_mean_ms", "Mean TPOT", _ms(sum(tpot) / len(tpot)) if tpot else None)
            lat.add("tpot_p50_ms", "P50 TPOT", _ms(percentile(tpot, 50)))
            lat.add("tpot_p90_ms", "P90 TPOT", _ms(percentile(tpot, 90)))
            speeds = [p.output_tokens / p.duration for p in perf if p.duration > 0]
            lat.add("stream_decode_speed", "Mean Per-Stream Speed (tokens/s)",
                    sum(speeds) / len(speeds) if speeds else None)
        return metrics

    def prefill(self, sampling_params: Mapping[str, Any], fmt: str = "terminal", width: int = 80,
                stream_ids: list[str] | None = None) -> Metrics:
        """One pass per stream with ``max_tokens`` 1: the engine computes and stores the prompt.

        Returns:
            The prefill report.

        Raises:
            LMCacheBatchedStreamError: Streams failed (``err.metrics`` has the report).
        """
        params = {**dict(sampling_params), "max_tokens": 1}
        return self._pass(params, fmt, width, "prefill", stream_ids)

    def decode(self, sampling_params: Mapping[str, Any], fmt: str = "terminal", width: int = 80,
               stream_ids: list[str] | None = None) -> Metrics:
        """One pass per stream that is not done, from its (edited) cache.

        Returns:
            The decode report.

        Raises:
            LMCacheBatchedStreamError: Streams failed (``err.metrics`` has the report).
        """
        return self._pass(sampling_params, fmt, width, "decode", stream_ids)

    def _pass(self, params: Mapping[str, Any], fmt: str, width: int, mode: str,
              stream_ids: list[str] | None) -> Metrics:
        duration, errors = self._run(params, stream_ids, mode)
        metrics = self.get_perf_metrics(duration, fmt, width, mode, stream_ids)
        if errors:
            raise _failure(mode, errors, metrics)
        return metrics

    # ------------------------------------------------------------------ modify
    def modify_request_streams(self, fn: ModifyFnType, stream_ids: list[str] | None = None,
                               timeout: float = 30.0, poll_interval: float = 0.2) -> float:
        """Edit every selected stream's cache with ``fn`` (bounded pipeline).

        Args:
            fn: ``fn({kind: tensor}, tokens) -> (new_kv, new_tokens)``.
            stream_ids: Streams to modify (None: all).
            timeout: Longest wait for a stream's cache to appear, in seconds.
            poll_interval: Longest delay between two lookups while waiting.

        Returns:
            Wall time in seconds.

        Raises:
            LMCacheBatchedStreamError: Streams failed (all listed; they are unchanged).
            LMCacheBatchedStreamServerError: The server was found gone (a stream failed
                and a liveness ping got no answer): the phase stopped at once; every
                stream not modified is listed (in flight: failed; the rest:
                ``not_attempted``). Also a ``ServerUnavailableError``.
        """
        out = self._modify(fn, stream_ids, timeout, poll_interval)
        if out.failed:
            raise _modify_failure(out, None)
        return out.seconds

    def _modify(self, fn: ModifyFnType, stream_ids: list[str] | None, timeout: float,
                poll_interval: float) -> ModifyOutcome:
        if not callable(fn):
            raise InvalidTypeError(f"fn must be callable, got {type(fn).__name__}")
        ids = self._select(stream_ids)
        streams = [self.request_streams[s] for s in ids]
        out = modify_streams(streams, fn, timeout=timeout, poll_interval=poll_interval,
                             max_in_flight=self.max_in_flight,
                             progress=_want_progress(self.progress, len(streams)))
        self.last_modify = out
        return out

    def modify(self, fn: ModifyFnType, fmt: str = "terminal", width: int = 80,
               timeout: float = 30.0, poll_interval: float = 0.2,
               stream_ids: list[str] | None = None) -> Metrics:
        """Edit every selected stream's cache and report what it took.

        See :meth:`modify_request_streams`.

        Returns:
            The modify report (``results.duration`` as in 0.5.6, plus streams, tokens,
            bytes, waits and per-stage times).

        Raises:
            LMCacheBatchedStreamError: Streams failed (``err.metrics`` has the report).
            LMCacheBatchedStreamServerError: The server was found gone; see
                :meth:`modify_request_streams`.
        """
        out = self._modify(fn, stream_ids, timeout, poll_interval)
        metrics = modify_metrics(out, fmt, width)
        if out.failed:
            raise _modify_failure(out, metrics)
        return metrics


def _modify_failure(out: ModifyOutcome, metrics: Metrics | None) -> LMCacheBatchedStreamError:
    """The error of a modify with failed streams (a server found gone: its own class)."""
    errors = {m.stream.request_stream_id: f"{m.stage}: {m.error}" for m in out.failed}
    gone = out.server_error
    if gone is None:
        return _failure("modify", errors, metrics)
    lines = "\n".join(f"  {sid}: {reason}" for sid, reason in errors.items())
    err = LMCacheBatchedStreamServerError(
        f"modify stopped, {gone}; {len(errors)} stream(s) not modified:\n{lines}", errors,
        metrics)
    err.report = gone.report
    return err


def modify_metrics(out: ModifyOutcome, fmt: str = "terminal", width: int = 80) -> Metrics:
    """The report of one modify."""
    metrics = Metrics(title="Batched Stream Modify Metrics")
    metrics.add_handler(StreamHandler(get_formatter(fmt, width=width)))
    ok = [m for m in out.items if m.error is None]
    cfg = metrics.add_section("config", "Configuration")
    cfg.add("num_request_streams", "Number of Request Streams", len(out.items))
    cfg.add("max_in_flight", "Max Streams In Flight", out.max_in_flight)
    res = metrics.add_section("results", "Results")
    res.add("duration", "Total Duration (s)", out.seconds)
    res.add("streams_modified", "Streams Modified", len(ok))
    res.add("streams_failed", "Streams Failed", len(out.items) - len(ok))
    res.add("streams_fused", "Streams Rewritten Slot To Slot",
            sum(m.path == "fused" for m in ok))
    res.add("tokens_before", "Cached Tokens Edited", sum(m.cached_len for m in ok))
    res.add("tokens_after", "Tokens After Edit", sum(len(m.new_tokens) for m in ok))
    res.add("read_mib", "Read (MiB)", sum(m.nbytes for m in out.items) / 2**20)
    res.add("stored_mib", "Stored (MiB)", out.bytes_stored / 2**20)
    res.add("peak_in_flight", "Peak Streams In Flight", out.peak_in_flight)
    st = metrics.add_section("stages", "Stage Time (s, summed over streams)")
    waits = [m.wait_s for m in out.items]
    st.add("wait_s", "Waiting For Engine Store", sum(waits))
    st.add("wait_max_s", "Longest Wait", max(waits) if waits else 0.0)
    st.add("lookups", "Lookups While Waiting", sum(m.lookups for m in out.items))
    for key, label in (("retrieve", "Read (incl. wait)"), ("fn", "Edit Function"),
                       ("store", "Store")):
        st.add(f"{key}_s", label, out.stage_seconds.get(key, 0.0))
    return metrics
