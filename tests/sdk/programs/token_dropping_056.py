"""Token dropping with the LMCache 0.5.6 SDK, written the way 0.5.6's docs and example do.

Prefill a batch of prompts on vLLM's OpenAI-compatible server, drop every 10th token's
KV from each cached prompt, then decode from the edited cache. The tests run this file
unchanged with ``import lmcache.sdk as lmc_sdk`` and with that one line replaced by
``import lmcache_kv_fast.sdk as lmc_sdk``.

One line differs from the example's hook: it yields every token of an event, where the
example yields only ``logprobs.tokens[-1]``. vLLM merges a request's deltas when its API
server falls behind (``RequestOutputCollector``), so the example then loses a token (one
CI run: 709 tokens against 710).
"""

import argparse
import json

import lmcache.sdk as lmc_sdk
import requests


def make_post_completion(vllm_url, model):
    def post_completion(prompt_token_ids, sampling_params, cache_salt):
        body = {"model": model, "prompt": prompt_token_ids, "stream": True, "logprobs": 0,
                **sampling_params}
        if cache_salt:
            body["cache_salt"] = cache_salt
        with requests.post(f"{vllm_url}/v1/completions", json=body, stream=True,
                           timeout=600) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    break
                choice = json.loads(data)["choices"][0]
                *merged, last = choice["logprobs"]["tokens"]  # "token_id:N" each
                for token in merged:
                    yield lmc_sdk.request.TokenEvent(int(token.split(":")[1]), "")
                yield lmc_sdk.request.TokenEvent(int(last.split(":")[1]), choice["text"])

    return post_completion


def drop_every_10th(tensors, tokens):
    kv = tensors[lmc_sdk.LMCacheSDKCacheKind.KV]  # [2, L, T, D]
    keep = [i for i in range(kv.shape[2]) if i % 10 != 9]
    return kv[:, :, keep, :], [tokens[i] for i in keep]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--http-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--vllm-url", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--salt", default="")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)

    ctx = lmc_sdk.connect(lmc_sdk.LMCacheSDKCacheKind.KV, args.url, args.http_url, args.model)
    post_completion = make_post_completion(args.vllm_url, args.model)
    batch = lmc_sdk.batch.LMCacheBatchedStream()
    for prompt in prompts:
        batch.add(lmc_sdk.request.create_request([ctx], post_completion, prompt,
                                                 cache_salt=args.salt))
    sampling_params = {"temperature": 0.0, "ignore_eos": True}
    batch.prefill(sampling_params).emit()
    batch.modify(drop_every_10th).emit()
    batch.decode({**sampling_params, "max_tokens": args.max_tokens}).emit()
    with open(args.out, "w") as f:
        json.dump({"tokens": [s.tokens for s in batch.request_streams.values()]}, f)
    ctx.close()


if __name__ == "__main__":
    main()
