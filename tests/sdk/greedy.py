"""Comparing two greedy runs that decoded from the same cached edit on one vLLM engine.

Concurrent requests are batched differently from run to run, and the engine's kernels
round a row differently in a batch of another size. The tests' model has random bf16
weights, whose next-token logits tie within a rounding often enough that one run's argmax
is the other's runner-up (seen in two fresh-clone CI runs, with both runs reading the
same number of cached tokens). So two runs must agree token for token, or part first
where the engine itself, asked alone for the log-probabilities at that point, scores both
tokens within ``TIE`` of its best: a near-tie, not an edit that differs.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Largest log-probability gap (nats) to the engine's best token that counts as a tie:
#: four bf16 steps of these logits (1/64 at their magnitude, ~4.5). Of 40 positions
#: sampled, 10 had their runner-up this close, and none closer than one step.
TIE = 4 / 64


def assert_same_greedy(engine, salt: str, runs: tuple[list[list[int]], list[list[int]]],
                       prompts: Sequence[Sequence[int]], edited_len: Sequence[int]) -> None:
    """Assert that the two runs' token lists agree, or part first at a near-tie.

    Args:
        engine: The ``OpenAIEngine`` both runs decoded on.
        salt: The cache salt of run ``runs[0]`` (its edit is the one re-read here).
        runs: Per run, per prompt, every token of the stream: the edited prompt, the
            prompt's tail, the prefill's token, then the decode's tokens.
        prompts: The prompts before the edit (the context of the prefill's token).
        edited_len: Per prompt, the edited prompt's length plus the tail's.
    """
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        if a == b:
            continue
        assert len(a) == len(b), f"prompt {i}: {len(a)} tokens against {len(b)}"
        j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        assert j >= edited_len[i], f"prompt {i}: the edited prompts differ at token {j}"
        # the prefill's token was chosen from the whole prompt, the others from the edit
        context = list(prompts[i]) if j == edited_len[i] else a[:j]
        lp = engine.complete(context, logprobs=1024, cache_salt=salt).logprobs[0]
        best = float(lp.max())
        gaps = [best - float(lp[a[j]]), best - float(lp[b[j]])]
        assert max(gaps) <= TIE, (f"prompt {i} token {j}: {a[j]} against {b[j]}, "
                                  f"{gaps} nats below the engine's best: not a tie")
