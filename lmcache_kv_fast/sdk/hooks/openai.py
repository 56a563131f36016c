"""A ``post_completion`` hook for vLLM's OpenAI-compatible server.

``POST {base_url}/v1/completions`` with the prompt as token ids, ``stream: true`` and
``logprobs: 0``; the server-sent events are read as they arrive and each generated token
id is taken from ``logprobs.tokens`` (``"token_id:N"``, which needs the server started
with ``--return-tokens-as-token-ids``). The stream's salt goes out as ``cache_salt``.
The final usage record (``stream_options.include_usage``) gives the prompt tokens the
engine did not compute (``usage.prompt_tokens_details.cached_tokens``, needs
``--enable-prompt-tokens-details``).

This is the reference hook of upstream's token-dropping example, with: every token of an
event (the example reads only the last one), the finish reason, timeouts on connecting
and on every read, and an :class:`EngineHookError` naming the URL and the cause for
refused connections, HTTP errors, error events, malformed events, missing token ids and
streams that end before ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from lmcache_kv_fast.sdk.hooks.common import EngineHookError, OnceStream, check_hook_args
from lmcache_kv_fast.sdk.request import TokenEvent

logger = logging.getLogger(__name__)

__all__ = ["OpenAICompletions"]

_TOKEN_PREFIX = "token_id:"
#: Body keys the hook sets itself (a sampling parameter cannot override them).
_RESERVED = ("model", "prompt", "stream")


class OpenAICompletions:
    """``post_completion`` over vLLM's ``/v1/completions`` (streamed).

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8000`` (``/v1`` is added).
        model: Model name for the requests (None: the server's only model, asked once
            from ``/v1/models``).
        connect_timeout: Seconds to connect.
        read_timeout: Longest wait for the response head and silence between two
            events, in seconds (a prefill of a long prompt on a CPU engine can take many
            seconds before the first event). On a timeout the hook closes the connection
            and vLLM aborts the request; keep it above the longest prefill (vLLM 0.32 with
            LMCacheMPConnector can lose its EngineCore when a request is aborted while a
            KV transfer is in flight: LMCache issues #4185, #4938).
        headers: Extra HTTP headers (e.g. ``Authorization``).
        extra_body: Extra fields for every request (sampling parameters override them).
        usage: Ask for the usage record (prompt tokens served from cache).

    Example:
        >>> hook = OpenAICompletions("http://127.0.0.1:8000")      # doctest: +SKIP
        >>> stream = lmc_sdk.request.create_request([ctx], hook, prompt_ids)  # doctest: +SKIP
    """

    def __init__(self, base_url: str, model: str | None = None, *,
                 connect_timeout: float = 10.0, read_timeout: float = 600.0,
                 headers: Mapping[str, str] | None = None,
                 extra_body: Mapping[str, Any] | None = None, usage: bool = True) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise EngineHookError(f"base_url must be an http(s) URL, got {base_url!r:.80}")
        base = base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model = model
        self.timeout = (float(connect_timeout), float(read_timeout))
        self.headers = dict(headers or {})
        self.extra_body = dict(extra_body or {})
        self.usage = usage
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def url(self) -> str:
        """The completions endpoint."""
        return f"{self.base_url}/v1/completions"

    def _session(self) -> Any:
        import requests

        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.trust_env = False  # loopback engines: no proxies from the environment
        return s

    def _model(self) -> str:
        with self._lock:
            if self.model is not None:
                return self.model
            import requests

            url = f"{self.base_url}/v1/models"
            try:
                resp = self._session().get(url, headers=self.headers, timeout=self.timeout)
            except requests.RequestException as err:
                raise EngineHookError(f"GET {url} failed: {type(err).__name__}: {err}") from err
            if resp.status_code != 200:
                raise EngineHookError(f"GET {url} answered HTTP {resp.status_code}: "
                                      f"{resp.text[:500]}")
            ids = [m.get("id") for m in (resp.json().get("data") or [])]
            if len(ids) != 1:
                raise EngineHookError(f"{url} serves {len(ids)} models ({ids}); pass model=")
            self.model = str(ids[0])
            return self.model

    def body(self, prompt: list[int], params: dict[str, Any], cache_salt: str) -> dict[str, Any]:
        """The JSON body of a request."""
        body: dict[str, Any] = {**self.extra_body}
        body.update({k: v for k, v in params.items() if k not in _RESERVED})
        body.update(model=self._model(), prompt=prompt, stream=True)
        lp = body.get("logprobs")
        body["logprobs"] = 0 if lp is None else lp  # token ids come with the logprobs
        if self.usage:
            opts = dict(body.get("stream_options") or {})
            opts.setdefault("include_usage", True)
            body["stream_options"] = opts
        if cache_salt:
            body["cache_salt"] = cache_salt
        return body

    def __call__(self, prompt_token_ids: list[int], sampling_params: dict[str, Any],
                 cache_salt: str) -> _CompletionStream:
        """Start a completion; iterate the result for its tokens as they arrive."""
        prompt, params, salt = check_hook_args(prompt_token_ids, sampling_params, cache_salt)
        return _CompletionStream(self, self.body(prompt, params, salt))


class _CompletionStream(OnceStream):
    """The tokens of one streamed completion (iterate once).

    Attributes:
        finish_reason: The engine's finish reason, once the stream ended.
        num_cached_tokens: Prompt tokens the engine did not compute (usage record), or None.
        prompt_tokens: Prompt tokens the engine counted, or None.
    """

    _what = "completion stream"

    def __init__(self, hook: OpenAICompletions, body: dict[str, Any]) -> None:
        super().__init__()
        self._hook = hook
        self._body = body
        self.prompt_tokens: int | None = None

    def _events(self) -> Iterator[TokenEvent]:
        import requests

        hook, url = self._hook, self._hook.url
        try:
            resp = hook._session().post(url, json=self._body, headers=hook.headers,
                                        timeout=hook.timeout, stream=True)
        except requests.ConnectTimeout as err:
            raise EngineHookError(f"POST {url}: no connection within {hook.timeout[0]}s "
                                  f"({err})") from err
        except requests.Timeout as err:  # no response head within the read timeout
            raise EngineHookError(f"POST {url}: no response within {hook.timeout[1]}s "
                                  f"(read timeout; {err})") from err
        except requests.RequestException as err:
            raise EngineHookError(f"POST {url} failed: {type(err).__name__}: {err}") from err
        try:
            if resp.status_code != 200:
                raise EngineHookError(
                    f"POST {url} answered HTTP {resp.status_code}: {resp.text[:1000]}")
            done = False
            try:
                for raw in resp.iter_lines(decode_unicode=False):
                    if not raw or raw.startswith(b":"):
                        continue
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    yield from self._parse(data, url)
            except requests.RequestException as err:
                raise EngineHookError(
                    f"reading the stream of POST {url} failed: {type(err).__name__}: {err} "
                    f"(read timeout {hook.timeout[1]}s)") from err
            if not done:
                raise EngineHookError(f"the stream of POST {url} ended before [DONE]")
        finally:
            resp.close()

    def _parse(self, data: bytes, url: str) -> Iterator[TokenEvent]:
        try:
            event = json.loads(data)
        except ValueError as err:
            raise EngineHookError(f"malformed event from {url}: {data[:200]!r}") from err
        if not isinstance(event, dict):
            raise EngineHookError(f"malformed event from {url}: {data[:200]!r}")
        if "error" in event:
            raise EngineHookError(f"{url} reported an error: {json.dumps(event['error'])[:1000]}")
        usage = event.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.num_cached_tokens = int(details["cached_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.prompt_tokens = int(usage["prompt_tokens"])
        for choice in event.get("choices") or []:
            lp = choice.get("logprobs") or {}
            tokens = lp.get("tokens") if isinstance(lp, dict) else None
            text = choice.get("text") or ""
            fin = choice.get("finish_reason")
            if tokens is None:
                if text:
                    raise EngineHookError(
                        f"{url} sent text without token ids: start vLLM with "
                        "--return-tokens-as-token-ids (and keep logprobs on)")
                tokens = []
            ids = [_token_id(t, url) for t in tokens]
            for i, tid in enumerate(ids):
                last = i == len(ids) - 1
                yield TokenEvent(tid, text if last else "", fin if last else None)
            if fin:
                self.finish_reason = fin


def _token_id(text: Any, url: str) -> int:
    if not isinstance(text, str) or not text.startswith(_TOKEN_PREFIX):
        raise EngineHookError(
            f"{url} sent token {text!r:.60} instead of 'token_id:N': start vLLM with "
            "--return-tokens-as-token-ids")
    try:
        return int(text[len(_TOKEN_PREFIX):])
    except ValueError as err:
        raise EngineHookError(f"{url} sent a malformed token id {text!r:.60}") from err
