"""Reference rotated keys from ``transformers`` (run by the engine venv's python, not pytest).

Usage: ``python rope_oracle_child.py IN.pt OUT.pt``. ``IN.pt`` holds ``k`` (raw keys
``[T, H, Dh]`` float32) and ``cases`` (``name``, a Llama-style ``config`` dict,
``interleaved``, ``old`` / ``new`` positions). For each case the keys are rotated at the old
and at the new positions by transformers' own code: ``LlamaConfig`` standardises the RoPE
parameters (both config forms), ``GPTNeoXRotaryEmbedding`` computes cos/sin for every
variant (dynamic update, partial rotary, yarn's attention factor included) and
``gpt_neox.apply_rotary_pos_emb`` (neox pairs) or ``glm.apply_rotary_pos_emb``
(interleaved pairs) applies them. Old and new positions go through one forward so a
``dynamic`` RoPE uses one set of frequencies (those of ``max(positions) + 1``).
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig
from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as apply_interleaved
from transformers.models.gpt_neox.modeling_gpt_neox import (
    GPTNeoXRotaryEmbedding,
)
from transformers.models.gpt_neox.modeling_gpt_neox import (
    apply_rotary_pos_emb as apply_neox,
)


def _case(k: torch.Tensor, case: dict) -> dict:
    """Rotated keys, frequencies and attention scaling of one case."""
    cfg = LlamaConfig(**case["config"])
    rot = GPTNeoXRotaryEmbedding(config=cfg)
    old, new = case["old"], case["new"]
    pos = torch.tensor([old + new], dtype=torch.int64)
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    apply = apply_interleaved if case["interleaved"] else apply_neox
    k4 = k.transpose(0, 1)[None]  # [1, H, T, Dh]
    n = len(old)
    k_old, _ = apply(k4, k4, cos[:, :n], sin[:, :n])
    k_new, _ = apply(k4, k4, cos[:, n:], sin[:, n:])
    return {"k_old": k_old[0].transpose(0, 1).contiguous(),
            "k_new": k_new[0].transpose(0, 1).contiguous(),
            "inv_freq": rot.inv_freq.clone(),
            "attention_scaling": float(rot.attention_scaling)}


def main() -> None:
    """Read the cases, write the references."""
    data = torch.load(sys.argv[1])
    k = data["k"]
    torch.save({c["name"]: _case(k, c) for c in data["cases"]}, sys.argv[2])


if __name__ == "__main__":
    main()
