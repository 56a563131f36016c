"""The transformers oracle: K/V and next-token logprobs computed by ``transformers``.

It runs the same weights as the engine in an engine-venv child
(``engine_side/oracle_driver.py``).

It also hands out what SnapKV needs to be checked against: the query states of a
prompt's last positions and the attention probabilities transformers computes for them.

K/V use the SDK's documented per-token form ``[2, L, T, NH*HS]`` (float32; K after the
rotary embedding), the same form ``lmcache_kv_fast.layout.cpu_engine`` converts a CPU
engine's raw rows to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from testbed.engine_proc import ChildOwner, EngineChild


class TransformersOracle(ChildOwner):
    """``AutoModelForCausalLM`` on the model directory, in float32 by default.

    Args:
        model: Model directory.
        dtype: Compute dtype name (the weights are bf16; float32 keeps the oracle's own
            rounding far below bf16's).
    """

    def __init__(self, model: str | Path, *, dtype: str = "float32",
                 start_timeout: float = 300.0) -> None:
        self._child = EngineChild("oracle_driver.py", {"model": str(model), "dtype": dtype},
                                  name="hf-oracle", start_timeout=start_timeout)
        self.info: dict[str, Any] = {}

    def _ready(self, info: dict[str, Any]) -> None:
        self.info = info

    def kv(self, tokens: list[int]) -> torch.Tensor:
        """K/V of ``tokens`` from one forward pass: ``[2, L, T, NH*HS]`` float32."""
        return self._child.call_load("kv", tokens=[int(t) for t in tokens])

    def next_logprobs(self, tokens: list[int], past_kv: torch.Tensor | None = None,
                      start_pos: int | None = None) -> torch.Tensor:
        """Log-softmax of the logits after ``tokens`` (float32 ``[V]``).

        Args:
            tokens: Tokens fed in this forward pass.
            past_kv: Optional ``[2, L, P, NH*HS]`` used as past key values as is (K already
                rotated at whatever positions it was computed for).
            start_pos: Position of ``tokens[0]`` (default P).
        """
        vec = self._child.call_send("next_logprobs", past_kv, key="past_path",
                                    tokens=[int(t) for t in tokens], start_pos=start_pos)
        return torch.tensor(vec, dtype=torch.float32)

    def window_attention(self, tokens: list[int], window: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and attention of the last ``window`` positions of ``tokens``, per layer.

        One forward with eager attention and ``output_attentions=True``.

        Returns:
            ``(queries, attentions)``, float32: the post-RoPE query states
            ``[L, Hq, window, head_dim]`` transformers attends with, and the probabilities
            it computes for those rows ``[L, Hq, window, T]`` (causal: zero beyond each
            row's own position).
        """
        out = self._child.call_load("window_attention", tokens=[int(t) for t in tokens],
                                    window=int(window))
        return out["queries"], out["attentions"]
