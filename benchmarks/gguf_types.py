"""Every GGUF type's kernels (kernels/gguf_gemm.c) against the weight-streaming floor.

For each type, a stack of Qwen2-1.5B-shaped matrices (q, k, v, o, gate, up, down of hidden 1536,
intermediate 8960: one layer's worth, repeated until the packed bytes pass `--mbytes`, so that the
weights stream from memory as in a decode step, never from cache) is multiplied by M rows, one
matrix after another; GFLOP/s = 2 M N K / time, against the floor = the bytes of the weights at
the memory bandwidth measured in the same run (a 2-thread read of 1 GiB). Medians of 3 passes.
Each ISA variant this CPU runs can be measured (`--variants all`); int_gemm.c's repacked Q4_1
(what the default model uses) is the baseline row.

    python -m benchmarks.gguf_types [--rows 1,8,32,128] [--types Q4_K,Q6_K] [--variants all]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagedllm.kernels import build as kernel_build
from pagedllm.kernels import isa
from pagedllm.quantization.kernels.gguf_kernel import TYPES, GGUFTensor
from tests.gguf_random import ALL_TYPES, random_tensor

LAYER = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960)]


def bandwidth_gbs() -> float:
    """GB/s of a 2-thread read of 1 GiB (torch sum), median of 5."""
    big = torch.ones(1 << 28)
    big.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    return big.numel() * 4 / statistics.median(times) / 1e9


def make_stack(type_name: str, mbytes: float) -> list[GGUFTensor]:
    one = [GGUFTensor(torch.from_numpy(np.ascontiguousarray(random_tensor(type_name, n, k, seed=i)).view(np.uint8)
                                       .reshape(n, -1)), type_name, (n, k)) for i, (n, k) in enumerate(LAYER)]
    per_layer = sum(t.nbytes for t in one)
    copies = max(1, int(mbytes * 1e6 / per_layer + 0.999))
    return [t._replace(data=t.data.clone()) for _ in range(copies) for t in one]


def run_stack(kernel, stack: list[GGUFTensor], m: int, compute: str) -> float:
    """Seconds for one pass over the stack at m rows (median of 3, after one warm-up)."""
    xs = {k: torch.randn(m, k) for k in {t.shape[1] for t in stack}}
    outs = {n: torch.empty(m, n) for n in {t.shape[0] for t in stack}}
    threads = torch.get_num_threads()
    scratch = torch.empty(max(kernel.int8_scratch(m, 8960), 144 * 8960 * 4), dtype=torch.uint8)

    def one_pass():
        for t in stack:
            x, y = xs[t.shape[1]], outs[t.shape[0]]
            fn = kernel.int8 if compute == "int8" else kernel.exact
            rc = fn(TYPES[t.type_name], x.data_ptr(), t.data.data_ptr(), y.data_ptr(), scratch.data_ptr(), m,
                    t.shape[0], t.shape[1], t.shape[0], threads)
            assert rc == 0, rc

    one_pass()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--types", default=",".join(t for t in ALL_TYPES if t != "F32"))
    p.add_argument("--variants", default="", help="'all': every variant this CPU runs; or names; default: the chosen one")
    p.add_argument("--mbytes", type=float, default=300.0, help="packed bytes per stack (well past the caches)")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    variants = [None] if not args.variants else (
        [v.name for v in isa.runnable_variants()] if args.variants == "all" else args.variants.split(","))
    gbs = bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, read bandwidth {gbs:.1f} GB/s")
    for variant in variants:
        kernel = kernel_build.gguf_gemm_kernel(variant)
        name = variant or kernel_build.kernel_state("gguf_gemm.c").variant
        print(f"\n## variant {name}")
        print("| type | bits/weight | path | floor GFLOP/s @1 | " + " | ".join(f"{m} rows" for m in rows) + " | % of floor @1 |")
        print("|---|---|---|---|" + "---|" * len(rows) + "---|")
        for type_name in args.types.split(","):
            stack = make_stack(type_name, args.mbytes)
            weights = sum(t.shape[0] * t.shape[1] for t in stack)
            nbytes = sum(t.nbytes for t in stack)
            floor_s = nbytes / (gbs * 1e9)
            floor_gflops = 2 * weights / floor_s / 1e9
            for compute in ("exact", "int8"):
                if compute == "int8" and type_name in ("F16", "BF16", "F32"):
                    continue
                cells, first = [], None
                for m in rows:
                    s = run_stack(kernel, stack, m, compute)
                    gflops = 2 * m * weights / s / 1e9
                    first = first if first is not None else gflops
                    cells.append(f"{gflops:.1f}")
                print(f"| {type_name} | {8 * nbytes / weights:.2f} | {compute} | {floor_gflops:.1f} | "
                      + " | ".join(cells) + f" | {100 * first / floor_gflops:.0f}% |", flush=True)
            del stack


if __name__ == "__main__":
    main()
