"""A ``post_completion`` hook for an in-process ``vllm.LLM``.

``vllm.LLM.generate`` runs one batch to completion and is not meant to be called from
several threads, while a batched stream calls its hook from one thread per stream. This
hook adds each call's prompt to the engine (``llm.llm_engine.add_request`` with
delta outputs) and lets the calling threads take turns stepping the engine: whichever
thread finds its own tokens not there yet steps the engine once and hands every
request's new tokens to its owner. Concurrent streams are thus batched by vLLM like
the requests of one ``generate`` call, and each stream sees its tokens as they are
produced (TTFT and TPOT are real). No background thread is left behind.

While the hook is in use, do not call ``llm.generate`` from another thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

from lmcache_kv_fast.sdk.hooks.common import EngineHookError, OnceStream, check_hook_args
from lmcache_kv_fast.sdk.request import TokenEvent

__all__ = ["VllmLLMCompletion"]

_IDS = itertools.count()
#: A waiting thread checks this often whether it should step the engine itself.
_POLL_S = 0.005


class VllmLLMCompletion:
    """``post_completion`` over an in-process ``vllm.LLM``.

    Args:
        llm: The ``vllm.LLM`` (its model must accept token-id prompts).
        request_prefix: Prefix of the engine request ids of this hook.
    """

    def __init__(self, llm: Any, *, request_prefix: str = "lmcache-sdk") -> None:
        engine = getattr(llm, "llm_engine", None)
        if engine is None or not hasattr(engine, "add_request") or not hasattr(engine, "step"):
            raise EngineHookError(
                f"llm must be a vllm.LLM (with .llm_engine), got {type(llm).__name__}")
        self.llm = llm
        self._engine = engine
        self._prefix = request_prefix
        self._engine_lock = threading.Lock()
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._queues_lock = threading.Lock()

    def __call__(self, prompt_token_ids: list[int], sampling_params: dict[str, Any],
                 cache_salt: str) -> _LLMStream:
        """Start a generation; iterate the result for its tokens as they are produced."""
        prompt, params, salt = check_hook_args(prompt_token_ids, sampling_params, cache_salt)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if params.get("n", 1) != 1:
            raise EngineHookError(f"n={params['n']!r}: a stream takes one sequence per pass")
        try:
            sp = SamplingParams(**params)
        except (TypeError, ValueError) as err:
            raise EngineHookError(f"bad sampling_params {params!r:.200}: {err}") from err
        sp.output_kind = RequestOutputKind.DELTA
        tp = TokensPrompt(prompt_token_ids=prompt)
        if salt:
            tp["cache_salt"] = salt
        return _LLMStream(self, tp, sp)

    # ------------------------------------------------------------------ engine turns
    def _submit(self, prompt: Any, params: Any) -> tuple[str, queue.SimpleQueue[Any]]:
        rid = f"{self._prefix}-{next(_IDS)}"
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._queues_lock:
            self._queues[rid] = q
        try:
            with self._engine_lock:
                self._engine.add_request(rid, prompt, params)
        except Exception as err:
            with self._queues_lock:
                self._queues.pop(rid, None)
            raise EngineHookError(f"vLLM refused the request: {type(err).__name__}: {err}") from err
        return rid, q

    def _step_once(self) -> None:
        """Step the engine once (if no other thread does) and deliver the outputs."""
        if not self._engine_lock.acquire(blocking=False):
            return
        try:
            if not self._engine.has_unfinished_requests():
                return
            try:
                outputs = self._engine.step()
            except Exception as err:
                with self._queues_lock:
                    waiting = list(self._queues.values())
                for q in waiting:
                    q.put(err)
                return
        finally:
            self._engine_lock.release()
        for out in outputs:
            with self._queues_lock:
                q = self._queues.get(getattr(out, "request_id", ""))
            if q is not None:
                q.put(out)

    def _abort(self, rid: str) -> None:
        with self._queues_lock:
            self._queues.pop(rid, None)
        with self._engine_lock:
            try:
                self._engine.abort_request([rid])
            except Exception:  # the request finished meanwhile
                pass

    def _finish(self, rid: str) -> None:
        with self._queues_lock:
            self._queues.pop(rid, None)


class _LLMStream(OnceStream):
    """The tokens of one generation (iterate once).

    Attributes:
        finish_reason: vLLM's finish reason once it ended.
        num_cached_tokens: Prompt tokens vLLM did not compute (prefix cache or LMCache).
    """

    _what = "generation"

    def __init__(self, hook: VllmLLMCompletion, prompt: Any, params: Any) -> None:
        super().__init__()
        self._hook, self._prompt, self._params = hook, prompt, params

    def _events(self) -> Iterator[TokenEvent]:
        hook = self._hook
        rid, q = hook._submit(self._prompt, self._params)
        finished = False
        try:
            while not finished:
                try:
                    item = q.get(timeout=_POLL_S)
                except queue.Empty:
                    hook._step_once()
                    continue
                if isinstance(item, BaseException):
                    raise EngineHookError(
                        f"vLLM failed while generating: {type(item).__name__}: {item}") from item
                finished = bool(item.finished)
                if item.num_cached_tokens is not None:
                    self.num_cached_tokens = int(item.num_cached_tokens)
                comp = item.outputs[0] if item.outputs else None
                if comp is None:
                    continue
                ids = list(comp.token_ids)
                text = comp.text or ""
                fin = comp.finish_reason if finished else None
                for i, tid in enumerate(ids):
                    last = i == len(ids) - 1
                    yield TokenEvent(int(tid), text if last else "", fin if last else None)
                if finished:
                    self.finish_reason = comp.finish_reason
        finally:
            if finished:
                hook._finish(rid)
            else:
                hook._abort(rid)
