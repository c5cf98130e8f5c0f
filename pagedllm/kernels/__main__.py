"""`python -m pagedllm.kernels [--all-variants] [--jobs N]`: build every C kernel library into the
kernel cache ahead of use (an install step, an image build, scripts/test.sh), so that no engine
start-up or test waits on a compiler."""

from __future__ import annotations

import argparse

from pagedllm.kernels.build import prebuild
from pagedllm.kernels.isa import runnable_variants
from pagedllm.model_source import cache_dir


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedllm.kernels [--all-variants] [--jobs N]`: fill the kernel cache."""
    parser = argparse.ArgumentParser(prog="python -m pagedllm.kernels",
                                     description="Build the C kernels into the kernel cache ahead of use.")
    parser.add_argument("--all-variants", action="store_true",
                        help="every instruction-set variant this CPU runs, not only the best one")
    parser.add_argument("--jobs", type=int, default=None, help="compilers run at once (default: the CPU count)")
    args = parser.parse_args(argv)
    variants = [v.name for v in runnable_variants()] if args.all_variants else None
    states = prebuild(variants, args.jobs)
    failed = {key: state.reason for key, state in states.items() if not state.active}
    print(f"{len(states) - len(failed)} of {len(states)} kernel libraries ready in {cache_dir() / 'kernels'}")
    for (source, variant), reason in sorted(failed.items()):
        print(f"  {source} [{variant}]: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
