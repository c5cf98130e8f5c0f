"""Multi-LoRA (issue 27): what serving adapters costs against the base model, and what loading
one on demand adds to a request's time to first token.

    python -m benchmarks.lora                  # default model, rank 16, medians of 3
    python -m benchmarks.lora --quick          # smoke test: tiny workload, one run

Adapters: `--num-adapters` PEFT adapters of rank `--rank` on every projection (q, k, v, o,
gate, up, down) of the default model, made by peft itself from transformers' float32 copy of
the GGUF (random A and B, so every token's delta is computed for real), cached under
`$PAGEDLLM_CACHE_DIR/bench-adapters`.

Throughput (seed20: 20 random-token prompts at once, exact output lengths), runs alternating,
medians of `--repeats`: the base model alone (enable_lora off), the LoRA engine serving only
the base, every request on 1 adapter, and 4 adapters round-robin (max_loras 4). Targets: 4
adapters >= 80% of the base alone, 1 adapter >= 90%.

Load on demand: one short request to an adapter that is not loaded yet (max_cpu_loras 1, the
other adapter evicted just before), against the same request to one already loaded: the
added time to first token (median of `--repeats` pairs). Target: <= 200 ms at rank 16.

Run under the shared CPU lock: `flock /tmp/pagedllm-cpu.lock python -m benchmarks.lora`.
Results: `--json-out` (default benchmarks/results/lora.json) and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.workloads import load_workload  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(gguf: str, n: int, rank: int, out_root: Path) -> list[Path]:
    """`n` rank-`rank` adapters of the model in `gguf` (made once, then reused)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [out_root / f"r{rank}-{i}" for i in range(n)]
    if all((p / "adapter_config.json").exists() for p in paths):
        return paths
    folder, name = os.path.split(gguf)
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                      init_lora_weights=False, lora_dropout=0.0))
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0.0, 0.01)
        peft_model.save_pretrained(path)
        del model, peft_model
    return paths


def throughput(llm, prompts, params, loras) -> tuple[float, float]:
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, dt


def time_to_first_token(llm, prompt_ids: list[int], lora) -> float:
    from pagedllm import SamplingParams

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    engine.add_request(f"ttft-{time.monotonic_ns()}", {"prompt_token_ids": prompt_ids},
                       SamplingParams(temperature=0.0, max_tokens=2), lora_request=lora)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
    return first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="seed20")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-space", type=float, default=1.0)
    p.add_argument("--json-out", default="benchmarks/results/lora.json")
    p.add_argument("--quick", action="store_true", help="tiny workload, one run, no JSON")
    args = p.parse_args()
    if args.quick:
        args.workload, args.repeats, args.json_out = "tiny", 1, None

    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.model_source import cache_dir, default_model_path

    gguf = str(default_model_path())
    root = Path(cache_dir()) / "bench-adapters"
    paths = make_adapters(gguf, args.num_adapters, args.rank, root)
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(paths)]
    reqs = load_workload(args.workload, 49152, seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    configs = {
        "base, LoRA off": (dict(), None),
        "LoRA on, base requests": (dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank), [None] * len(reqs)),
        "1 adapter": (dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank), [loras[0]] * len(reqs)),
        f"{len(loras)} adapters round-robin": (dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank),
                                              [loras[i % len(loras)] for i in range(len(reqs))]),
    }
    engines = {}
    for name, (kw, lora) in configs.items():
        key = tuple(sorted(kw.items()))
        if key not in engines:
            engines[key] = LLM(gguf, kv_cache_space=args.kv_cache_space, **kw)
        llm = engines[key]
        llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False,
                     lora_request=None if lora is None else lora[:2])  # warm-up (loads adapters)
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.repeats):
        for name, (kw, lora) in configs.items():
            rate, _ = throughput(engines[tuple(sorted(kw.items()))], prompts, params, lora)
            runs[name].append(rate)
            print(f"  pass {r + 1} {name}: {rate:.2f} tok/s", flush=True)
    base = statistics.median(runs["base, LoRA off"])
    rows = [{"config": name, "output_tokens_per_s": round(statistics.median(v), 2),
             "runs": [round(x, 2) for x in v], "vs_base": round(statistics.median(v) / base, 3)}
            for name, v in runs.items()]
    del engines
    gc.collect()

    # load on demand: max_cpu_loras 1, the adapter evicted before each cold request
    llm = LLM(gguf, kv_cache_space=args.kv_cache_space, enable_lora=True, max_loras=1, max_cpu_loras=1,
              max_lora_rank=args.rank)
    short = reqs[0].prompt_token_ids[:32]
    time_to_first_token(llm, short, loras[0])  # warm-up
    cold, warm = [], []
    for _ in range(max(3, args.repeats)):
        time_to_first_token(llm, short, loras[1])  # loras[0] leaves host memory (max_cpu_loras 1)
        llm.llm_engine.remove_lora(loras[0].lora_int_id)
        cold.append(time_to_first_token(llm, short, loras[0]))
        warm.append(time_to_first_token(llm, short, loras[0]))
    added_ms = 1e3 * (statistics.median(cold) - statistics.median(warm))
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.processor() or platform.machine(),
              "workload": args.workload, "rank": args.rank, "repeats": args.repeats, "throughput": rows,
              "load_on_demand": {"cold_ttft_ms": [round(1e3 * x, 1) for x in cold],
                                 "warm_ttft_ms": [round(1e3 * x, 1) for x in warm],
                                 "added_ms_median": round(added_ms, 1)},
              "command": "python -m benchmarks.lora" + (" --quick" if args.quick else "")}
    print(f"\n## {args.workload}, rank {args.rank}, medians of {args.repeats}")
    print("| configuration | output tok/s | runs | vs base |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['output_tokens_per_s']} | {row['runs']} | {row['vs_base']}x |")
    print(f"\nload on demand (rank {args.rank}): TTFT cold {result['load_on_demand']['cold_ttft_ms']} ms, "
          f"warm {result['load_on_demand']['warm_ttft_ms']} ms: {added_ms:.1f} ms added (median)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
