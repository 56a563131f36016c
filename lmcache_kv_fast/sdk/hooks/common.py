"""What the engine hooks share."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from lmcache_kv_fast.errors import KVCacheSDKError

if TYPE_CHECKING:
    from lmcache_kv_fast.sdk.request import TokenEvent

__all__ = ["EngineHookError", "OnceStream", "check_hook_args"]


class EngineHookError(KVCacheSDKError):
    """The engine could not serve a stream's pass (HTTP failure, timeout, bad answer)."""


def check_hook_args(prompt_token_ids: Any, sampling_params: Any, cache_salt: Any
                    ) -> tuple[list[int], dict[str, Any], str]:
    """The three hook arguments, checked and copied.

    Raises:
        EngineHookError: A prompt that is not a list of ints, sampling parameters that
            are not a mapping, a salt that is not a str.
    """
    if not isinstance(sampling_params, Mapping):
        raise EngineHookError(
            f"sampling_params must be a mapping, got {type(sampling_params).__name__}")
    if not isinstance(cache_salt, str):
        raise EngineHookError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    try:
        prompt = [int(t) for t in prompt_token_ids]
    except (TypeError, ValueError) as err:
        raise EngineHookError(f"prompt_token_ids must be token ids: {err}") from err
    if not prompt:
        raise EngineHookError("prompt_token_ids is empty")
    return prompt, dict(sampling_params), cache_salt


class OnceStream:
    """The tokens of one engine pass, iterable once (a hook's return value).

    Subclasses produce the tokens in :meth:`_events` and fill the attributes as they
    learn them.

    Attributes:
        finish_reason: The engine's finish reason, once the stream ended.
        num_cached_tokens: Prompt tokens the engine did not compute, or None.
    """

    #: What one pass is called in the error of a second iteration.
    _what = "stream"

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        self.num_cached_tokens: int | None = None
        self._started = False

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._started:
            raise EngineHookError(f"a {self._what} can be iterated once")
        self._started = True
        return self._events()

    def _events(self) -> Iterator[TokenEvent]:
        raise NotImplementedError
