"""Ready ``post_completion`` engine hooks for request streams.

* :class:`OpenAICompletions` — vLLM's OpenAI-compatible server (``/v1/completions``,
  token-id prompts, streamed SSE, ``--return-tokens-as-token-ids``).
* :class:`VllmLLMCompletion` — an in-process ``vllm.LLM``; concurrent streams are batched
  by the engine (one driver thread steps it).

Both yield :class:`~lmcache_kv_fast.sdk.request.TokenEvent` with ``finish_reason`` on
the last token and raise :class:`EngineHookError` (an ``LMCacheSDKError``) with what
went wrong.
"""

from __future__ import annotations

from lmcache_kv_fast.sdk.hooks.common import EngineHookError
from lmcache_kv_fast.sdk.hooks.openai import OpenAICompletions
from lmcache_kv_fast.sdk.hooks.vllm_llm import VllmLLMCompletion

__all__ = ["EngineHookError", "OpenAICompletions", "VllmLLMCompletion"]
