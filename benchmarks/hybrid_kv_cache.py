"""The hybrid KV cache (docs/hybrid_kv_cache.md): KV bytes per sequence and concurrent sequences
in a fixed budget, with the KV cache groups and without (--disable-hybrid-kv-cache-manager),
in one run.

    python -m benchmarks.hybrid_kv_cache --json-out benchmarks/results/hybrid_kv_cache.json

Models: tiny random checkpoints (transformers' own classes, hidden 64) with the real layer
pattern and windows of Gemma 3 4B (34 layers, five sliding to one full, window 1024) and
Gemma 2 2B (26 layers alternating, window 4096): KV bytes scale with layers x KV heads x
head_dim, so the ratios are the real models'; only the absolute bytes are tiny.

For each model and each length L (8k and 32k tokens): a budget of bytes that holds
--baseline-seqs sequences of L tokens in the one-table layout (4 at 8k, 2 at 32k); --requests prompts of L - 128
random tokens, 128 output tokens each (EOS ignored), all submitted at once, chunked prefill in
steps of --max-num-batched-tokens tokens, no prefix caching (no sharing: every block is one
sequence's). After every step:
- bytes per sequence: the blocks a decoding sequence holds over its groups x the bytes of a
  block (after its first decode step; the step of its last prefill chunk holds that chunk in
  every group, reported as the peak), against the theoretical minimum (full layers x L + sliding layers x window, each
  rounded up to blocks, no unused slots);
- concurrency: how many sequences of that size the budget holds (budget // bytes per
  sequence), and how many requests were seen decoding at once (all their tokens held; at 32k
  the prefill chunks' pace, not memory, can bound it: 16 chunks per prompt against 128 decode
  steps).
The engine's schedule does not depend on timing: every figure is exact and repeats run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 1000
OUTPUT_TOKENS = 128  # decode steps far outnumber one prefill's chunks: memory, not pace, bounds concurrency
DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, query_pre_attn_scalar=16)
MODELS: dict[str, dict[str, Any]] = {
    # google/gemma-3-4b-it's text config: 34 layers, every 6th global, window 1024
    "gemma3-4b-shaped": dict(kind="gemma3", num_hidden_layers=34, sliding_window=1024, sliding_window_pattern=6),
    # google/gemma-2-2b-it: 26 layers, sliding and global alternate, window 4096
    "gemma2-2b-shaped": dict(kind="gemma2", num_hidden_layers=26, sliding_window=4096),
}


def save_model(name: str, path: Path, max_len: int):
    """Save the tiny checkpoint at `path`; returns its transformers config."""
    import torch
    import transformers as tf

    from benchmarks.gpu_check import save_word_tokenizer

    spec = dict(MODELS[name])
    cls = tf.Gemma3TextConfig if spec.pop("kind") == "gemma3" else tf.Gemma2Config
    config = cls(**DIMS, **spec, max_position_embeddings=max_len)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    save_word_tokenizer(VOCAB, path)
    return config


def layer_windows(config) -> list[int | None]:
    """Each layer's window as the engine reads the config (None: full attention)."""
    from pagedllm.core.kv_cache_groups import hybrid_kv_cache_groups

    groups = hybrid_kv_cache_groups(config)
    out: dict[int, int | None] = {}
    for g in groups.groups:
        out.update({layer: g.sliding_window for layer in g.layer_ids})
    return [out[i] for i in sorted(out)]


def run_mode(path: Path, hybrid: bool, length: int, budget_bytes: int, num_requests: int, chunk: int,
             seed: int) -> dict[str, Any]:
    """One engine, the workload submitted at once, observed after every step."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=length, block_size=16, kv_cache_space=budget_bytes / (1 << 30),
              enable_prefix_caching=False, max_num_batched_tokens=chunk, max_num_seqs=256,
              disable_hybrid_kv_cache_manager=not hybrid, swap_space=0)
    engine = llm.llm_engine
    core = engine.core
    kv, sched = core.kv_cache_manager, core.scheduler
    per_block = core.bytes_per_block
    rng = random.Random(seed)
    prompt_len = length - OUTPUT_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"h{i}", {"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(prompt_len)]},
                           params)
    decoding_counts: list[int] = []
    # The most blocks a decoding sequence held over its groups: after its first decode step
    # (steady state: a sliding table holds its window), and at all (the step that ran its last
    # prefill chunk holds that chunk's blocks in every group: the kernel reads them).
    held_decoding = held_any = 0
    finished = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
        decoding = [s for s in sched.running if s.num_computed_tokens >= s.prompt_len]
        decoding_counts.append(len({s.request_id for s in decoding}))
        for s in decoding:
            held = sum(sum(1 for b in kv.tables[g].get(s.seq_id, ()) if b is not kv.null_block)
                       for g in range(len(kv.groups)))
            held_any = max(held_any, held)
            if s.num_computed_tokens > s.prompt_len:
                held_decoding = max(held_decoding, held)
    elapsed = time.perf_counter() - t0
    assert finished == num_requests
    stats = llm.kv_cache_stats()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    row = {
        "mode": "hybrid" if hybrid else "one table", "num_blocks": kv.num_usable_blocks,
        "bytes_per_block": per_block, "kv_cache_groups": len(kv.groups),
        "bytes_per_sequence": held_decoding * per_block,
        "peak_bytes_per_sequence": held_any * per_block,
        "concurrency_peak": max(decoding_counts), "concurrency_mean": statistics.mean(
            c for c in decoding_counts if c) if any(decoding_counts) else 0.0,
        "num_preemptions": stats.num_preemptions, "sliding_blocks_freed": stats.sliding_blocks_freed,
        "elapsed_s": elapsed,
    }
    llm.shutdown()
    return row


def measure(name: str, length: int, args, workdir: Path) -> dict[str, Any]:
    from pagedllm.core.kv_cache_groups import KVCacheGroups

    path = workdir / f"{name}-{length}"
    windows = layer_windows(save_model(name, path, length))
    layer_token_bytes = 2 * DIMS["num_key_value_heads"] * DIMS["head_dim"] * 4  # K and V, float32
    block = 16
    min_bytes = KVCacheGroups.theoretical_min_layer_blocks(windows, length, block) * block * layer_token_bytes
    one_table_bytes = len(windows) * -(-length // block) * block * layer_token_bytes
    baseline = args.baseline_seqs or max(2, 32768 // length)
    budget = int(baseline * one_table_bytes * 1.01)
    requests = args.requests or max(2 * baseline, int(baseline * one_table_bytes / min_bytes) + 2)
    row: dict[str, Any] = {"model": name, "tokens_per_sequence": length, "layers": len(windows),
                           "sliding_layers": sum(w is not None for w in windows), "budget_bytes": budget,
                           "requests": requests, "baseline_seqs": baseline, "theoretical_min_bytes": min_bytes,
                           "one_table_bytes": one_table_bytes}
    for hybrid in (False, True):
        r = run_mode(path, hybrid, length, budget, requests, args.max_num_batched_tokens, args.seed)
        key = "hybrid" if hybrid else "one_table"
        row[key] = r
        print(f"{name} L={length} {r['mode']}: {r}", flush=True)
    h, o = row["hybrid"], row["one_table"]
    row["hybrid_bytes_over_min"] = h["bytes_per_sequence"] / min_bytes
    row["concurrency_ratio"] = h["concurrency_peak"] / o["concurrency_peak"]
    return row


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | tokens/seq | KV bytes/seq, one table | hybrid | theoretical min | hybrid / min | "
             "hybrid peak (last prefill chunk) / min | sequences the budget holds, one table / hybrid | "
             "seen decoding at once, one table / hybrid | preemptions, one table / hybrid | "
             "blocks freed by windows |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, h = r["one_table"], r["hybrid"]
        fit_o, fit_h = (r["budget_bytes"] // x["bytes_per_sequence"] for x in (o, h))
        lines.append(
            f"| {r['model']} | {r['tokens_per_sequence']} | {o['bytes_per_sequence']:,} | "
            f"{h['bytes_per_sequence']:,} | {r['theoretical_min_bytes']:,} | {r['hybrid_bytes_over_min']:.3f} | "
            f"{h['peak_bytes_per_sequence'] / r['theoretical_min_bytes']:.3f} | "
            f"{fit_o} / {fit_h} ({fit_h / fit_o:.2f}x) | "
            f"{o['concurrency_peak']} / {h['concurrency_peak']} ({r['concurrency_ratio']:.2f}x) | "
            f"{o['num_preemptions']} / {h['num_preemptions']} | {h['sliding_blocks_freed']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768])
    p.add_argument("--baseline-seqs", type=int, default=None,
                   help="sequences of L tokens the budget holds in the one-table layout "
                        "(default: 32768 // L, at least 2)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: enough to fill the hybrid layout's budget)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-hybrid-bench-") as tmp:
        for name in args.models:
            for length in args.lengths:
                rows.append(measure(name, length, args, Path(tmp)))
    table = markdown_table(rows)
    print(table)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "table": table}, indent=2))
    return rows


if __name__ == "__main__":
    main()
