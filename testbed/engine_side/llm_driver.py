"""Offline vLLM engine (``vllm.LLM``) with LMCache's ``LMCacheMPConnector``, as an RPC child.

Standalone script for the engine venv, started by ``testbed.engine``
(never imports ``lmcache_kv_fast``). ``argv[1]`` is a JSON config::

    {"model": DIR, "lmcache_port": P, "lmcache_host": "tcp://127.0.0.1", "block_size": 128,
     "max_model_len": 2048, "kv_space_gb": 1, "max_logprobs": 1024, "dtype": "bfloat16",
     "tmp_dir": DIR}

Ops (JSON-lines, see ``rpc_child``): ``generate``, ``block_ids``, ``read_blocks``, ``isa``,
``reset_prefix_cache``, ``metrics``, ``kernel_probe``, ``sdk_workflow`` (the sdk package's
batched stream with the in-process hook on this engine, ``sdk_inproc.py``; the only op
that imports ``lmcache_kv_fast``).

To read the engine's own paged KV, a hook is installed in the worker process (via
``collective_rpc``; vLLM runs the worker in a child of its engine-core process on CPU): it
records, per request, the block ids the scheduler hands the worker (new requests' block
tables plus blocks added later). Those blocks stay in vLLM's prefix cache after the
request finished, so ``read_blocks`` can copy them out of ``kv_caches`` afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import rpc_child

logger = logging.getLogger("lmcache_kv_fast.engine_side")

_RECORD = "_lmckvf_block_record"


def _install_block_hook(worker: Any) -> dict[str, Any]:
    """Runs in the worker: wrap ``execute_model`` to record each request's block ids."""
    import sys as _sys

    main = _sys.modules["__main__"].__dict__
    record: dict[str, list[list[int]]] = main.setdefault(_RECORD, {})
    inner = worker.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        for req in scheduler_output.scheduled_new_reqs:
            record[req.req_id] = [list(ids) for ids in req.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if new is not None and rid in record:
                for group, ids in enumerate(new):
                    record[rid][group].extend(ids)
        return inner(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model
    ctx = worker.model_runner.compilation_config.static_forward_context
    layers = {n: layer for n, layer in ctx.items() if hasattr(layer, "kv_cache")}
    return {
        "pid": os.getpid(),
        "layers": list(layers),
        "isa": [str(getattr(layer, "isa", None)) for layer in layers.values()],
        "kv_shape": [list(_layer_cache(layer).shape) for layer in layers.values()],
        "kv_dtype": [str(_layer_cache(layer).dtype) for layer in layers.values()],
    }


def _layer_cache(layer: Any) -> Any:
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, list | tuple) else kv


def _get_record(worker: Any) -> dict[str, Any]:
    import sys as _sys

    return dict(_sys.modules["__main__"].__dict__.get(_RECORD, {}))


def _kv_layers(worker: Any) -> list[Any]:
    ctx = worker.model_runner.compilation_config.static_forward_context
    return [_layer_cache(layer) for layer in ctx.values() if hasattr(layer, "kv_cache")]


def _read_blocks(worker: Any, block_ids: list[int]) -> Any:
    """Runs in the worker: ``[L, len(block_ids), NH, BS, 2*HS]`` copied out of the caches."""
    import torch

    idx = torch.tensor(block_ids, dtype=torch.long)
    return torch.stack([cache.index_select(0, idx).clone() for cache in _kv_layers(worker)])


class Driver:
    """The engine and the RPC ops on it."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.llm: Any = None
        self.hook_info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        """Build the engine and install the worker hook."""
        from vllm import LLM

        cfg = self.cfg
        kv_transfer = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": cfg.get("lmcache_host", "tcp://127.0.0.1"),
                "lmcache.mp.port": int(cfg["lmcache_port"]),
            },
        }
        self.llm = LLM(
            model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True,
            dtype=cfg.get("dtype", "bfloat16"), block_size=int(cfg.get("block_size", 128)),
            max_model_len=int(cfg.get("max_model_len", 2048)), enable_prefix_caching=True,
            max_logprobs=int(cfg.get("max_logprobs", 1024)), seed=0, disable_log_stats=False,
            kv_transfer_config=kv_transfer, **cfg.get("engine_args", {}),
        )
        self.hook_info = self.llm.collective_rpc(_install_block_hook)[0]
        return {"pid": os.getpid(), **self.hook_info}

    def generate(self, prompts: list[dict[str, Any]], max_tokens: int = 1,
                 logprobs: int | None = None) -> list[dict[str, Any]]:
        """Greedy generation; per prompt: ids, dense logprob vectors, cached tokens, request id."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=int(max_tokens), temperature=0.0,
                                logprobs=logprobs, ignore_eos=True)
        inputs = []
        for p in prompts:
            tp = TokensPrompt(prompt_token_ids=[int(t) for t in p["tokens"]])
            if p.get("cache_salt"):
                tp["cache_salt"] = p["cache_salt"]
            inputs.append(tp)
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out in outs:
            comp = out.outputs[0]
            dense = None
            if logprobs is not None and comp.logprobs is not None:
                dense = []
                for pos in comp.logprobs:
                    vec = [float("-inf")] * (max(pos) + 1)
                    for tok, lp in pos.items():
                        vec[tok] = float(lp.logprob)
                    dense.append(vec)
            result.append({
                "request_id": out.request_id,
                "token_ids": list(comp.token_ids),
                "logprobs": dense,
                "num_cached_tokens": out.num_cached_tokens,
            })
        return result

    def block_ids(self, request_id: str) -> list[int]:
        """Block ids the scheduler gave request ``request_id`` (single KV group)."""
        record = self.llm.collective_rpc(_get_record)[0]
        hits = [v for k, v in record.items() if k == request_id or k.startswith(f"{request_id}-")]
        if len(hits) != 1:
            raise KeyError(f"request {request_id!r}: {len(hits)} matching records")
        if len(hits[0]) != 1:
            raise ValueError(f"request {request_id!r}: {len(hits[0])} KV cache groups")
        return hits[0][0]

    def read_blocks(self, block_ids: list[int], path: str) -> dict[str, Any]:
        """Save ``[L, nb, NH, BS, 2*HS]`` of the given blocks to ``path``."""
        import torch

        data = self.llm.collective_rpc(_read_blocks, args=([int(b) for b in block_ids],))[0]
        torch.save(data, path)
        return {"shape": list(data.shape), "dtype": str(data.dtype)}

    def isa(self) -> dict[str, Any]:
        """The worker hook's view: attention layers, their kernel ISA and cache shapes."""
        return self.hook_info

    def kernel_probe(self, cases: list[dict[str, Any]], path: str) -> int:
        """Run ``kernel_probe.probe`` (vLLM's own cache writer per ISA); save to ``path``."""
        import kernel_probe
        import torch

        torch.save(kernel_probe.probe(cases), path)
        return len(cases)

    def sdk_workflow(self, **cfg: Any) -> dict[str, Any]:
        """Prefill -> modify -> decode with ``lmcache_kv_fast.sdk`` on this engine in-process."""
        import sdk_inproc

        return sdk_inproc.run(self.llm, cfg)

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's local prefix cache (later hits can only come from LMCache)."""
        return bool(self.llm.reset_prefix_cache())

    def metrics(self) -> dict[str, float]:
        """Counters and gauges whose name mentions the prefix cache."""
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if "prefix_cache" in m.name and hasattr(m, "value"):
                out[m.name] = float(m.value)
        return out

    def shutdown(self) -> None:
        """Stop the engine core (the parent kills the process group anyway)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as err:  # best effort; the process group is killed next
                logger.warning("engine shutdown: %r", err)


def main() -> None:
    """Start the engine, then serve requests."""
    out = rpc_child.take_stdout()
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.get("kv_space_gb", 1)))
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc callables
    drv = Driver(cfg)
    rpc_child.start_or_fail(out, drv.start)
    ops = {name: getattr(drv, name) for name in (
        "generate", "block_ids", "read_blocks", "isa", "reset_prefix_cache",
        "metrics", "kernel_probe", "sdk_workflow")}
    rpc_child.serve(out, ops, on_exit=drv.shutdown)


if __name__ == "__main__":
    main()
