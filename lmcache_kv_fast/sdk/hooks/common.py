"""What the engine hooks share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError

__all__ = ["EngineHookError", "check_hook_args"]


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
