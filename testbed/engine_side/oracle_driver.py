"""The transformers oracle: the same weights run by ``transformers``, as an RPC child.

Standalone script for the engine venv, started by ``testbed.oracle``
(never imports ``lmcache_kv_fast``). ``argv[1]`` is a JSON config
``{"model": DIR, "dtype": "float32", "tmp_dir": DIR}``: the bf16 weights are loaded into
``dtype`` (float32 by default, so the oracle's own rounding stays far below bf16's).

KV tensors are handed over as ``torch.save`` files in the SDK's documented per-token form
``[2, L, T, NH*HS]`` (plane 0 = K after rotary embedding, plane 1 = V); that is what
``past_key_values`` holds too (``[1, NH, T, HS]`` per layer and plane).

Ops: ``kv`` (K/V of a token sequence), ``next_logprobs`` (log-softmax of the next-token
logits after a token sequence, optionally continuing from given K/V as past key values) and
``window_attention`` (the post-RoPE query states of the last positions and the attention
probabilities transformers computes for them, eager attention).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import rpc_child


class Oracle:
    """The model and the RPC ops on it."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.model: Any = None

    def start(self) -> dict[str, Any]:
        """Load the model."""
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        dtype = getattr(torch, self.cfg.get("dtype", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(self.cfg["model"], dtype=dtype).eval()
        c = self.model.config
        return {"num_layers": c.num_hidden_layers, "num_kv_heads": c.num_key_value_heads,
                "head_dim": getattr(c, "head_dim", None), "dtype": str(dtype)}

    def kv(self, tokens: list[int], path: str) -> list[int]:
        """Save the K/V of ``tokens`` (one forward pass) as ``[2, L, T, NH*HS]`` float32."""
        import torch

        with torch.no_grad():
            out = self.model(torch.tensor([tokens]), use_cache=True)
        kv = self._flatten(out.past_key_values)
        torch.save(kv, path)
        return list(kv.shape)

    def next_logprobs(self, tokens: list[int], past_path: str | None = None,
                      start_pos: int | None = None) -> list[float]:
        """Log-probabilities of the token after ``tokens``.

        Args:
            tokens: Input tokens of this forward pass.
            past_path: Optional ``[2, L, P, NH*HS]`` K/V file used as past key values (the
                K already rotated; it is not touched).
            start_pos: Position of ``tokens[0]`` (default: P, the past length). The
                tokens get positions ``start_pos .. start_pos + len(tokens) - 1``.

        Returns:
            The vocabulary-sized log-softmax vector of the last position (float32).
        """
        import torch
        from transformers import DynamicCache

        past, plen = None, 0
        if past_path is not None:
            kv = torch.load(past_path).to(self.model.dtype)
            plen = kv.shape[2]
            nh = self.model.config.num_key_value_heads
            past = DynamicCache(config=self.model.config)
            for layer in range(kv.shape[1]):
                k, v = (kv[p, layer].reshape(plen, nh, -1).transpose(0, 1).unsqueeze(0)
                        for p in (0, 1))
                past.update(k.contiguous(), v.contiguous(), layer)
        start = plen if start_pos is None else int(start_pos)
        n = len(tokens)
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([tokens]),
                position_ids=torch.arange(start, start + n).unsqueeze(0),
                attention_mask=torch.ones(1, plen + n, dtype=torch.long),
                past_key_values=past, use_cache=past is not None,
            )
        return out.logits[0, -1].float().log_softmax(-1).tolist()

    def window_attention(self, tokens: list[int], window: int, path: str) -> list[int]:
        """Save the queries and attention of the last ``window`` positions of ``tokens``.

        One forward with eager attention and ``output_attentions=True``; the query states
        are those transformers' eager attention function receives (after RoPE), captured
        on their way in. Saves ``{"queries": [L, Hq, W, Dh], "attentions": [L, Hq, W, T]}``
        (float32): the probabilities are transformers' own, not recomputed.
        """
        import torch

        if not 1 <= window <= len(tokens):
            raise ValueError(f"window must be in 1 .. {len(tokens)}, got {window}")
        with self._captured_queries() as queries, torch.no_grad():
            out = self.model(torch.tensor([tokens]), output_attentions=True, use_cache=False)
        att = torch.stack([a[0, :, -window:] for a in out.attentions]).float()
        q = torch.stack([x[0, :, -window:] for x in queries]).float()
        torch.save({"queries": q.contiguous(), "attentions": att.contiguous()}, path)
        return list(att.shape)

    @contextmanager
    def _captured_queries(self) -> Iterator[list[Any]]:
        """Eager attention for the block, each layer's query states appended to the list.

        The model's modeling module looks ``eager_attention_forward`` up when a layer
        runs, so wrapping that name sees exactly the tensors transformers attends with.
        """
        mod = sys.modules[type(self.model).__module__]
        orig = getattr(mod, "eager_attention_forward", None)
        if orig is None:
            raise RuntimeError(f"{mod.__name__} has no eager_attention_forward to wrap")
        seen: list[Any] = []

        def capture(module: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(query.detach().clone())
            return orig(module, query, *args, **kwargs)

        before = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")
        mod.eager_attention_forward = capture
        try:
            yield seen
        finally:
            mod.eager_attention_forward = orig
            self.model.set_attn_implementation(before)

    def _flatten(self, cache: Any) -> Any:
        import torch

        planes = []
        for attr in ("keys", "values"):
            layers = [getattr(layer, attr)[0].transpose(0, 1) for layer in cache.layers]
            planes.append(torch.stack([t.reshape(t.shape[0], -1) for t in layers]))
        return torch.stack(planes).float().contiguous()


def main() -> None:
    """Load the model, then serve requests."""
    out = rpc_child.take_stdout()
    drv = Oracle(json.loads(sys.argv[1]))
    rpc_child.start_or_fail(out, drv.start)
    rpc_child.serve(out, {"kv": drv.kv, "next_logprobs": drv.next_logprobs,
                          "window_attention": drv.window_attention})


if __name__ == "__main__":
    main()
