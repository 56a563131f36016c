"""A tiny random-weight Llama written with ``transformers``, for the real-engine tests.

No model can be downloaded here, and vLLM's ``load_format="dummy"`` gives uniform logits
(useless for checking KV reuse). :func:`ensure_tiny_model` writes a small Llama with
fixed-seed random weights (3.4 MB, bf16) plus a word-level tokenizer (``w0`` .. ``w1023``;
the OpenAI-compatible server needs one even for token-id prompts) into a cache directory,
once; the writer runs in the engine venv (``scripts/engine-venv.sh``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from testbed.engine_proc import (
    ENGINE_SIDE_DIR,
    REPO_ROOT,
    EngineChildError,
    child_env,
    engine_python,
)

logger = logging.getLogger(__name__)

#: Environment variable overriding the model cache directory (default ``<repo>/.cache/engine``).
MODEL_CACHE_ENV = "LMCACHE_KV_FAST_ENGINE_CACHE"


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Geometry and weights of the tiny Llama (``LlamaConfig`` fields + seed and init scale).

    The defaults give 2 layers, 2 KV heads of 64 (``D = 128``), 4 query heads, vocab 1024.
    ``init_std`` 0.05 (instead of transformers' 0.02) makes the next-token distribution
    depend clearly on the context: a 10-token change 400 tokens back moves logprobs by
    ~0.5, about 20x what bf16 rounding does.
    """

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    torch_dtype: str = "bfloat16"
    seed: int = 1234
    init_std: float = 0.05

    def digest(self) -> str:
        """Short hash of the spec (names the cache directory)."""
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def model_cache_dir() -> Path:
    """Where tiny models are kept."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or REPO_ROOT / ".cache" / "engine")


def ensure_tiny_model(spec: TinyLlamaSpec | None = None, cache_dir: Path | None = None,
                      timeout: float = 300.0) -> Path:
    """Return the directory of the tiny model, writing it first if needed.

    Args:
        spec: Model spec (default :class:`TinyLlamaSpec`).
        cache_dir: Parent directory (default :func:`model_cache_dir`).
        timeout: Seconds the writer may take.

    Returns:
        Absolute path of the model directory (``config.json``, ``model.safetensors``,
        tokenizer files). vLLM registers this path string as the model name.

    Raises:
        EngineChildError: The writer failed.
    """
    spec = spec or TinyLlamaSpec()
    parent = (cache_dir or model_cache_dir()).resolve()
    out = parent / f"tiny-llama-{spec.digest()}"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    parent.mkdir(parents=True, exist_ok=True)
    script = ENGINE_SIDE_DIR / "make_tiny_model.py"
    proc = subprocess.run(
        [str(engine_python()), str(script), str(out), json.dumps(asdict(spec))],
        capture_output=True, text=True, env=child_env(), timeout=timeout, check=False,
    )
    if proc.returncode != 0 and not (out / "model.safetensors").exists():
        raise EngineChildError(
            f"writing the tiny model failed (code {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    logger.info("tiny model written: %s", out)
    return out
