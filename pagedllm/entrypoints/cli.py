"""`pagedllm` command line: `generate` (offline completions) and `chat` (one conversation)."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.entrypoints.arg_utils import add_engine_args, engine_config_from_args


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
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        seed=args.sampling_seed, stop=args.stop, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        ignore_eos=args.ignore_eos,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline and print the completions")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the model's chat template")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from pagedllm.llm import LLM

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
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
