"""Write a tiny random-weight Llama (+ a word-level tokenizer) for the engine tests.

Standalone script for the engine venv (``.venv-engine``: transformers, tokenizers, torch);
it never imports ``lmcache_kv_fast``. Usage::

    python make_tiny_model.py OUT_DIR SPEC_JSON

``SPEC_JSON`` holds the ``LlamaConfig`` fields plus ``seed`` and ``init_std``. The weights
are drawn from a fixed-seed generator, so the same spec gives the same bytes. The directory
is written under a temporary name and renamed into place, so a reader never sees half a
model. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile


def main() -> None:
    """Write the model directory named on the command line."""
    out_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    seed = int(spec.pop("seed"))
    init_std = float(spec.pop("init_std"))
    cfg = LlamaConfig(**spec, initializer_range=init_std)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # deterministic values independent of transformers' init order
        for _name, p in sorted(model.named_parameters()):
            if p.dim() == 1:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2",
            model_max_length=cfg.max_position_embeddings,
        )
        fast.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


if __name__ == "__main__":
    main()
