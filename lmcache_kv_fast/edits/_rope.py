"""The frozen description of a model's rotary position embedding (RoPE).

:class:`RoPE` holds what re-rotation needs: the head size, how many of its dims rotate,
how they pair (neox ``rotate_half`` or interleaved GPT-J pairs) and the per-pair
frequencies of the variant (default, ``linear``, ``dynamic``, ``llama3``, ``yarn``). The
frequencies are computed the way ``transformers`` (``modeling_rope_utils``) computes them,
in float32 with the same operations, so a re-rotation uses the engine's own angles.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["ROPE_TYPES", "RoPE"]

#: The RoPE variants this package re-rotates.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RoPE:
    """A model's RoPE, as far as re-rotating cached keys needs it.

    Attributes:
        rope_type: One of :data:`ROPE_TYPES`.
        head_dim: Size of one attention head.
        rotary_dim: Leading dims of each head that rotate (even; ``head_dim`` unless partial
            rotary); the rest pass through untouched.
        theta: The base (``rope_theta``).
        interleaved: Pairs are ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + rotary_dim/2)``
            (neox ``rotate_half``, Llama and most models).
        factor: Scaling factor of ``linear`` / ``dynamic`` / ``llama3`` / ``yarn``.
        max_position_embeddings: The config's ``max_position_embeddings``.
        original_max_position_embeddings: Pre-training length (``llama3``, ``yarn``).
        low_freq_factor: ``llama3`` parameter.
        high_freq_factor: ``llama3`` parameter.
        beta_fast: ``yarn`` parameter (default 32).
        beta_slow: ``yarn`` parameter (default 1).
        truncate: ``yarn``: round the correction range (default True).
        attention_factor: Magnitude factor the engine multiplies cos/sin by (``yarn``'s
            mscale; 1 otherwise). Informational: a rotation by an angle difference keeps
            whatever magnitude the cached keys carry, so re-rotation never applies it.
        dynamic_seq_len: ``dynamic``: the sequence length whose frequencies the cached keys
            were rotated with (None: ``max_position_embeddings``, i.e. the unscaled base,
            which is what vLLM uses and what transformers uses up to that length).
    """

    rope_type: str
    head_dim: int
    rotary_dim: int
    theta: float
    interleaved: bool = False
    factor: float = 1.0
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    dynamic_seq_len: int | None = None

    def inv_freq(self) -> torch.Tensor:
        """Per-pair angular frequencies, float32 ``[rotary_dim // 2]`` (transformers' values).

        Computed once per RoPE (an edit asks on every call); each call gets its own copy.
        """
        return _inv_freq(self).clone()

    def _compute_inv_freq(self) -> torch.Tensor:
        dim = self.rotary_dim
        exps = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        if self.rope_type == "dynamic":
            return 1.0 / (self._dynamic_base() ** exps)
        base_inv = 1.0 / (self.theta ** exps)
        if self.rope_type == "linear":
            return base_inv / self.factor
        if self.rope_type == "llama3":
            return self._llama3(base_inv)
        if self.rope_type == "yarn":
            return self._yarn()
        return base_inv

    def _dynamic_base(self) -> float:
        """NTK-scaled base for :attr:`dynamic_seq_len` (the plain base up to the trained length)."""
        max_pos = self.max_position_embeddings or 0
        seq_len = max(self.dynamic_seq_len or max_pos, max_pos)
        if max_pos <= 0:
            return self.theta
        dim = self.rotary_dim
        return self.theta * ((self.factor * seq_len / max_pos) - (self.factor - 1)) ** (
            dim / (dim - 2))

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Llama 3.1's band-wise scaling of the base frequencies."""
        old_len = self.original_max_position_embeddings or self.max_position_embeddings or 8192
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self) -> torch.Tensor:
        """YaRN's blend of interpolated and extrapolated frequencies (Peng et al. 2023)."""
        dim, base = self.rotary_dim, self.theta
        orig = self.original_max_position_embeddings or self.max_position_embeddings or 4096

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low),
                           0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extra = 1.0 / pos_freqs
        inter = 1.0 / (self.factor * pos_freqs)
        extra_factor = 1 - ramp
        return inter * (1 - extra_factor) + extra * extra_factor


@functools.lru_cache(maxsize=64)
def _inv_freq(rope: RoPE) -> torch.Tensor:
    return rope._compute_inv_freq()
