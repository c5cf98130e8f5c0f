"""What structured outputs cost: seed20 with every request constrained by one JSON schema vs
free, offline, and the compile time of a 50-property schema.

    flock /tmp/pagedllm-cpu.lock .venv/bin/python -m benchmarks.structured_outputs [--rows 1,32]

1. throughput: seed20 (benchmarks/workloads.py: 20 requests, prompts 78-178 random tokens,
   outputs 156-356, EOS ignored, greedy), all at once, `--repeats` timed runs each (median),
   free then constrained. The schema (an object holding an array of at least 200 person
   objects) cannot be complete before every request's max_tokens, so both runs generate exactly
   the same number of tokens and the ratio is one of tokens/s. Target: >= 0.85. The runs
   alternate (free, constrained, ...); the time spent filling masks (worker thread, overlapped
   with the forward) and applying them (sampler) is reported per run. `--rows 1,32`: the same
   with that many requests at once (the workload's requests repeated or cut), one line each:
   the constrained step's cost at one stream and at a full batch.
2. compile: a 50-property schema (strings, integers, numbers, booleans, enums, arrays, a nested
   object), compiled by a fresh xgrammar GrammarCompiler on the model's vocabulary (median of
   `--repeats`), and again from the compiler's cache.

One JSON line goes to stdout (and to --json-out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.workloads import load_workload  # noqa: E402

PEOPLE_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "email": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "age", "email", "tags"],
            },
        }
    },
    "required": ["people"],
}


def schema_50() -> dict:
    """50 properties of mixed kinds, all required."""
    kinds = [
        {"type": "string"},
        {"type": "integer", "minimum": 0},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "string", "enum": ["red", "green", "blue", "cyan"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 8},
        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
         "required": ["x", "y"]},
        {"type": ["string", "null"]},
        {"type": "string", "format": "date"},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the SmolLM2 GGUF")
    ap.add_argument("--workload", default="seed20")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-space", type=float, default=1.0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--rows", default=None, help="comma-separated batch sizes (default: the workload as is)")
    args = ap.parse_args()

    from pagedllm import LLM
    from pagedllm.model_source import default_model_path

    llm = LLM(args.model or str(default_model_path()), kv_cache_space=args.kv_cache_space)
    workload = load_workload(args.workload, llm.llm_engine.hf_config.vocab_size)
    lines = []
    for rows in ([int(r) for r in args.rows.split(",")] if args.rows else [len(workload)]):
        reqs = (workload * (rows // len(workload) + 1))[:rows]
        lines.append(measure(llm, args, reqs, rows, compile_too=not lines))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.writelines(line + "\n" for line in lines)


def measure(llm, args, reqs, rows: int, compile_too: bool) -> str:
    """One JSON line: free vs constrained tok/s with `rows` requests at once."""
    from pagedllm import SamplingParams
    from pagedllm.structured_outputs_params import StructuredOutputsParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    so = StructuredOutputsParams(json=PEOPLE_SCHEMA)

    def params(constrained: bool) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True,
                               structured_outputs=so if constrained else None) for r in reqs]

    llm.generate(prompts[:2], params(True)[:2], use_tqdm=False)  # warm-up (compiles the schema)

    def run(constrained: bool) -> tuple[float, int, list[str]]:
        llm.reset_prefix_cache()
        p = params(constrained)
        t = time.perf_counter()
        outs = llm.generate(prompts, p, use_tqdm=False)
        elapsed = time.perf_counter() - t
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].text for o in outs]

    # Where the constrained run's extra time goes: mask filling (the core's worker thread,
    # overlapped with the forward) and the sampler's masked fill (on the critical path).
    import pagedllm.layers.sampler as sampler_mod

    spent = {"fill_s": 0.0, "apply_s": 0.0, "steps": 0}
    manager = llm.llm_engine.core.structured
    fill, apply = manager.build_masks, sampler_mod.apply_token_bitmask

    def timed_fill(entries):
        t = time.perf_counter()
        try:
            return fill(entries)
        finally:
            spent["fill_s"] += time.perf_counter() - t
            spent["steps"] += 1

    def timed_apply(*a, **kw):
        t = time.perf_counter()
        try:
            return apply(*a, **kw)
        finally:
            spent["apply_s"] += time.perf_counter() - t

    manager.build_masks, sampler_mod.apply_token_bitmask = timed_fill, timed_apply
    try:
        result = _timed_runs(llm, args, run, spent, rows)
    finally:
        manager.build_masks, sampler_mod.apply_token_bitmask = fill, apply
    if compile_too:
        result.update(_compile_times(llm, args))
    line = json.dumps(result)
    print(line, flush=True)
    return line


def _timed_runs(llm, args, run, spent, rows: int) -> dict:
    """Free and constrained runs, interleaved, `args.repeats` each; medians and mask costs."""
    result: dict = {"workload": args.workload, "rows": rows, "repeats": args.repeats,
                    "threads": __import__("torch").get_num_threads()}
    # Interleaved (free, constrained, free, ...): drift of the machine's load hits both alike.
    runs: dict[str, list] = {"free": [], "constrained": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(run(name == "constrained"))
    for name, rs in runs.items():
        tokens = rs[0][1]
        assert all(r[1] == tokens for r in rs)
        elapsed = statistics.median(r[0] for r in rs)
        result[name] = {"tokens": tokens, "median_s": round(elapsed, 3),
                        "tok_per_s": round(tokens / elapsed, 1),
                        "runs_s": [round(r[0], 3) for r in rs]}
    # The output really is the schema's (a prefix of it: max_tokens cuts it).
    texts = runs["constrained"][0][2]
    assert all(t.startswith("{") and '"people"' in t[:40] for t in texts), texts[:2]
    assert result["free"]["tokens"] == result["constrained"]["tokens"]
    n = args.repeats
    result["mask_fill_ms_per_step"] = round(spent["fill_s"] / max(spent["steps"], 1) * 1e3, 3)
    result["mask_fill_s_per_run"] = round(spent["fill_s"] / n, 3)
    result["mask_apply_s_per_run"] = round(spent["apply_s"] / n, 3)
    result["ratio"] = round(result["constrained"]["tok_per_s"] / result["free"]["tok_per_s"], 3)
    return result


def _compile_times(llm, args) -> dict:
    """A 50-property schema's compile time, cold (fresh compilers) and from the cache."""
    import xgrammar as xgr

    result: dict = {}

    info = xgr.TokenizerInfo.from_huggingface(llm.get_tokenizer(),
                                              vocab_size=llm.llm_engine.hf_config.vocab_size)
    schema = json.dumps(schema_50())
    cold = []
    for _ in range(args.repeats):
        compiler = xgr.GrammarCompiler(info, max_threads=2)
        t = time.perf_counter()
        compiler.compile_json_schema(schema)
        cold.append(time.perf_counter() - t)
    t = time.perf_counter()
    compiler.compile_json_schema(schema)
    cached = time.perf_counter() - t
    result["compile_50_properties_ms"] = round(statistics.median(cold) * 1e3, 1)
    result["compile_50_properties_runs_ms"] = [round(c * 1e3, 1) for c in cold]
    result["compile_50_properties_cached_ms"] = round(cached * 1e3, 3)
    return result


if __name__ == "__main__":
    main()
