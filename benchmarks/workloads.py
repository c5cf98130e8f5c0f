"""Fixed, seeded workloads: random-token prompts with exact output lengths (EOS ignored)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    prompt: str | None = None  # text prompts of a dataset (sent as text to servers)


def random_requests(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int) -> list[BenchRequest]:
    """n requests; lengths uniform in the inclusive ranges; token ids avoid the first 100
    (special tokens live there in the models we serve)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        out.append(BenchRequest([rng.randrange(100, vocab_size) for _ in range(plen)], olen))
    return out


WORKLOADS = {
    # "20 concurrent, input 128±50, output 256±100"
    "seed20": dict(n=20, prompt_range=(78, 178), output_range=(156, 356)),
    "burst200": dict(n=200, prompt_range=(64, 192), output_range=(64, 192)),
    "single": dict(n=1, prompt_range=(32, 32), output_range=(256, 256)),
    "tiny": dict(n=4, prompt_range=(8, 16), output_range=(4, 8)),  # smoke tests
}


# ShareGPT-like lengths without the dataset (no network): lognormal prompt and output lengths whose
# means before filtering are ShareGPT's as the vLLM paper reports them (Fig. 11: 161 input, 338
# output tokens, long-tailed), then vLLM's benchmark filter: both at least 4 tokens, the prompt at
# most 1024, prompt + output at most 2048 (a draw that fails is drawn again).
SHAREGPT_LIKE = {"sharegpt1000": 1000}
SHAREGPT_PROMPT_MEAN, SHAREGPT_PROMPT_SIGMA = 161.0, 1.0
SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA = 338.0, 0.9


def sharegpt_like_requests(n: int, vocab_size: int, seed: int, max_prompt: int = 1024,
                           max_total: int = 2048) -> list[BenchRequest]:
    """n requests with ShareGPT-like lengths (see SHAREGPT_LIKE), prompts as random token ids
    (ids >= 100, as `random_requests`): the length mix is what a throughput figure depends on."""
    rng = random.Random(seed)

    def draw(mean: float, sigma: float) -> int:  # a lognormal of this mean: mu = ln(mean) - sigma^2 / 2
        return int(round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))

    out = []
    while len(out) < n:
        plen = draw(SHAREGPT_PROMPT_MEAN, SHAREGPT_PROMPT_SIGMA)
        olen = draw(SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA)
        if plen < 4 or olen < 4 or plen > max_prompt or plen + olen > max_total:
            continue
        out.append(BenchRequest([rng.randrange(100, vocab_size) for _ in range(plen)], olen))
    return out


def load_workload(name: str, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    if name in SHAREGPT_LIKE:
        return sharegpt_like_requests(SHAREGPT_LIKE[name], vocab_size, seed)
    if name not in WORKLOADS:
        raise ValueError(f"Unknown workload {name!r}; known: {sorted(WORKLOADS) + sorted(SHAREGPT_LIKE)}.")
    return random_requests(vocab_size=vocab_size, seed=seed, **WORKLOADS[name])


def load_dataset(path: str, tokenizer=None) -> list[BenchRequest]:
    """A JSON list of {"prompt" | "prompt_token_ids", "max_tokens"}; text prompts are
    tokenized when a tokenizer is given, else kept as text."""
    items = json.loads(open(path).read())
    out = []
    for i, item in enumerate(items):
        if "prompt_token_ids" in item:
            ids = list(item["prompt_token_ids"])
        elif "prompt" in item:
            ids = tokenizer.encode(item["prompt"]) if tokenizer is not None else []
        else:
            raise ValueError(f"Dataset item {i} has neither 'prompt' nor 'prompt_token_ids'.")
        out.append(BenchRequest(ids, int(item["max_tokens"]), item.get("prompt")))
    return out
