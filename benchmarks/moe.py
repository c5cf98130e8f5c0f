"""One mixture-of-experts block's forward (float32, CPU): pagedllm's grouped experts (layers/moe.py:
each expert once on all of its tokens, through the C kernels' prepared weights) against
- `per-token`: a Python loop over tokens and their k experts (the same prepared Linear layers),
- `dense`: every expert on every token (pagedllm's CUDA-graph capture path, for reference),
- `transformers`: transformers 5.24's own `MixtralSparseMoeBlock` with the same weights.
All variants are first checked to give the same output. Each figure is the median of
`--repeats` timed runs (each the mean of `--iters` calls after one warm-up call), in ms per call;
`ratio` is the variant's time over pagedllm's.

    flock /tmp/pagedllm-cpu.lock .venv/bin/python -m benchmarks.moe --tokens 1 16 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch


def build(hidden: int, inter: int, experts: int, top_k: int, seed: int = 0):
    """(our block, transformers' block) of a Mixtral config, the same random weights."""
    import transformers as tf
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from pagedllm.layers.moe import SparseMoeBlock
    from pagedllm.model.mixtral import mixtral_spec

    cfg = tf.MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                           num_experts_per_tok=top_k, num_attention_heads=8, num_key_value_heads=8, vocab_size=32)
    torch.manual_seed(seed)
    theirs = MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.05)
    ours = SparseMoeBlock(cfg, mixtral_spec(cfg), torch.float32, "cpu", prefix="model.layers.0.mlp")
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, ex in enumerate(ours.experts):
            ex.gate_up_proj.weight.copy_(theirs.experts.gate_up_proj[e])
            ex.down_proj.weight.copy_(theirs.experts.down_proj[e])
    for m in ours.modules():
        if m is not ours and hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading()
    return ours, theirs


def per_token(block, x: torch.Tensor) -> torch.Tensor:
    """The naive baseline: each token, each of its k experts, one at a time."""
    weights, ids = block.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * block.experts[int(ids[t, j])](x[t:t + 1])[0]
    return out


def timed(fn: Callable[[], torch.Tensor], iters: int, repeats: int) -> list[float]:
    fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t) / iters * 1000)
    return runs


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--skip-per-token-above", type=int, default=256,
                   help="skip the per-token loop for more tokens than this (it is slow)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedllm.layers.moe import dense_experts

    ours, theirs = build(args.hidden, args.intermediate, args.experts, args.top_k)
    rows = []
    for tokens in args.tokens:
        torch.manual_seed(tokens)
        x = torch.randn(tokens, args.hidden)
        variants: dict[str, Callable[[], torch.Tensor]] = {
            "pagedllm": lambda: ours(x),
            "dense": lambda: dense_experts(x, *ours.gate(x), ours.experts),
            "transformers": lambda: theirs(x.unsqueeze(0))[0],
        }
        if tokens <= args.skip_per_token_above:
            variants["per-token"] = lambda: per_token(ours, x)
        ref = variants["pagedllm"]()
        for name, fn in variants.items():
            diff = float((fn() - ref).abs().max())
            if diff > 1e-3:
                raise RuntimeError(f"{name} differs from pagedllm by {diff:.3g} at {tokens} tokens")
        times = {name: timed(fn, args.iters, args.repeats) for name, fn in variants.items()}
        base = statistics.median(times["pagedllm"])
        for name, runs in times.items():
            med = statistics.median(runs)
            rows.append({"tokens": tokens, "variant": name, "ms": round(med, 3),
                         "runs_ms": [round(r, 3) for r in runs], "ratio": round(med / base, 2)})
    result = {"hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts,
              "top_k": args.top_k, "threads": torch.get_num_threads(), "rows": rows}
    print(f"{'tokens':>6}  {'variant':<13}{'ms':>10}{'ratio':>8}")
    for r in rows:
        print(f"{r['tokens']:>6}  {r['variant']:<13}{r['ms']:>10.3f}{r['ratio']:>8.2f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
