"""`pagedllm` command line: `serve` (the OpenAI-compatible server), `generate` (offline
completions), `quantize` (write a quantized checkpoint folder) and `bench`."""

from __future__ import annotations

import argparse
import importlib
import logging
import platform
import sys
from pathlib import Path

import pagedllm
from pagedllm import envs
from pagedllm.entrypoints.arg_utils import (
    add_engine_args,
    add_server_args,
    engine_config_from_args,
)
from pagedllm.entrypoints.openai.serve_start import start_serving
from pagedllm.kernels.status import kernel_status
from pagedllm.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace):
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        seed=args.sampling_seed, stop=args.stop, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        ignore_eos=args.ignore_eos,
    )


class _VersionAction(argparse.Action):
    """`pagedllm --version`: the version, then the kernel report (builds the kernels if needed)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import torch  # lazy: only --version needs it

        print(f"pagedllm {pagedllm.__version__} (torch {torch.__version__}, Python {platform.python_version()})")
        print(kernel_status().describe())
        parser.exit()


class _HelpEnvAction(argparse.Action):
    """`pagedllm --help-env`: every environment variable pagedllm reads (pagedllm/envs.py)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(envs.table_markdown(), end="")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM engine")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version and which compute kernels run here (C or torch), then exit")
    parser.add_argument("--help-env", action=_HelpEnvAction,
                        help="print every environment variable pagedllm reads, with its type and default, then exit")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                           description="Start the OpenAI-compatible HTTP server (default model: "
                                       "SmolLM2-135M-Instruct).")
    add_server_args(serve)
    add_engine_args(serve, model_positional=True)
    gen = sub.add_parser("generate", help="complete prompts offline and print the completions")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the model's chat template")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    add_quantize_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (run from a source checkout)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    # Their flags are the benchmark modules' own: main() hands them over unparsed.
    for name, help_text in BENCHMARKS.items():
        bench_sub.add_parser(name, help=help_text, add_help=False)
    return parser


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="write a quantized checkpoint folder (GPTQ / AWQ / compressed-tensors)",
                       description="Quantize a float model (HF folder, .gguf file, or the default SmolLM2) and "
                                   "write a checkpoint folder that pagedllm (and vLLM) load. See docs/quantization.md.")
    q.add_argument("model", nargs="?", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    q.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    q.add_argument("--method", default="rtn", choices=("rtn", "gptq", "awq"),
                   help="rtn: round to nearest; gptq: Hessian error compensation; awq: activation-aware scales "
                        "(gptq and awq read calibration text)")
    q.add_argument("--bits", type=int, default=4, choices=(4, 8))
    q.add_argument("--group-size", type=int, default=64,
                   help="input columns per scale, -1 per channel (SmolLM2: 64 or 32; 128 does not divide 576)")
    q.add_argument("--format", default="gptq", choices=("gptq", "awq", "compressed-tensors"))
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None,
                     help="symmetric (default for gptq, compressed-tensors)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric zero points (default for awq)")
    q.add_argument("--act-order", action="store_true", help="gptq format: act-order columns and g_idx")
    q.add_argument("--checkpoint-format", default="gptq", choices=("gptq", "gptq_v2"),
                   help="gptq format: v1 stores zero - 1 (the default, what AutoGPTQ writes), v2 the zero")
    q.add_argument("--calibration", default=None,
                   help="gptq / awq: a UTF-8 text file to calibrate on (default: the text shipped with pagedllm)")
    q.add_argument("--num-samples", type=int, default=None,
                   help="gptq / awq: calibration windows (default: as many as the text holds, at most 128)")
    q.add_argument("--seq-len", type=int, default=512, help="gptq / awq: tokens per calibration window")
    q.add_argument("--damp-percent", type=float, default=0.01, help="gptq: dampening, a fraction of mean diag(H)")
    q.add_argument("--activations", default=None, choices=("int8",),
                   help="int8: W8A8, written as compressed-tensors int-quantized (dynamic int8 activations); "
                        "needs --format compressed-tensors --bits 8 --group-size -1")
    q.add_argument("--no-awq-clip", dest="awq_clip", action="store_false", help="awq: skip the clipping search")
    q.add_argument("--awq-search-samples", type=int, default=8,
                   help="awq: how many calibration windows the scale and clip searches evaluate on")


def run_quantize(args: argparse.Namespace) -> int:
    # lazy here and below: the CLI parses its flags (and answers --help) without torch
    from pagedllm.quantization.algorithms.checkpoint_writer import quantize_model

    path = quantize_model(args.model, args.out, method=args.method, bits=args.bits, group_size=args.group_size,
                          fmt=args.format, sym=args.sym, act_order=args.act_order,
                          checkpoint_format=args.checkpoint_format, calibration=args.calibration,
                          num_samples=args.num_samples, seq_len=args.seq_len, damp_percent=args.damp_percent,
                          awq_clip=args.awq_clip, awq_search_samples=args.awq_search_samples,
                          activations=args.activations)
    print(f"wrote {path}")
    return 0


BENCHMARKS = {
    "memory": "KV memory: waste, concurrency, sharing, prefix caching",
    "throughput": "offline throughput, pagedllm vs transformers / vLLM / a server",
    "serving": "online serving latency and throughput against an OpenAI-compatible URL",
    "latency": "one batch: prefill and decode step times",
}


def run_bench(name: str, bench_args: list[str]) -> int:
    """The benchmarks live in the repository's `benchmarks/` package, next to `pagedllm/`."""
    root = Path(__file__).resolve().parents[2]
    if (root / "benchmarks" / f"{name}.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(f"benchmarks.{name}")
    except ImportError as exc:
        raise ValueError("`pagedllm bench` needs the source checkout (benchmarks/).") from exc
    module.main(bench_args)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from pagedllm.llm import LLM  # lazy: torch and the engine

    config = engine_config_from_args(args)
    llm = LLM.from_engine_config(config)
    params = sampling_params_from_args(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        print(f"=== Prompt: {prompt!r}")
        for c in out.outputs:
            label = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{label}{c.text}")
            print(f"    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    stats = llm.kv_cache_stats()
    print(f"KV cache: peak {stats.peak_used_blocks}/{stats.num_blocks} blocks, "
          f"waste at peak {stats.waste_at_peak:.2%}, preemptions {stats.num_preemptions}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        try:
            return run_bench(argv[1], argv[2:])
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            # Bad flags and a busy port fail here, before the model load; the engine cores
            # then load the model while this process imports the server (serve_start.py).
            started = start_serving(args)
            from pagedllm.entrypoints.openai.api_server import run_server  # lazy: torch, fastapi

            return run_server(args, started)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "quantize":
            return run_quantize(args)

    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
