"""The projections' kernels on SmolLM2-135M's shapes: float32 panels (packed_gemm.c), the exact
block form a float32 weight on a Q4_1 grid gets (`prepare_weight`: int_gemm.c since block_gemm.c
was retired; the table in docs/quantization.md measured block_gemm.c in that column), and
int_gemm.c's exact and int8 paths on int4 g64 / Q4_1-like g32 weights. GFLOP/s per batch size
(rows), median of 5 after warm-up.

    python -m benchmarks.int_gemm [--rows 1,8,32,128,512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.layers.linear import linear, prepare_weight
from pagedllm.quantization.kernels.int_kernel import int_gemm_isa, int_matmul, pack_int_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _time(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        times.append((time.perf_counter() - t0) / 10)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,8,32,128,512")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"int_gemm ISA: {int_gemm_isa()}, threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    forms = {}
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
        d32 = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
        m32 = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
        q41 = codes.float().view(n, k // 32, 32) * d32.unsqueeze(-1) + m32.unsqueeze(-1)  # Q4_1 values
        w_float = torch.randn(n, k, generator=g) * 0.05
        prepare_weight(w_float)
        q41 = q41.view(n, k).contiguous()
        prepare_weight(q41)  # the old path: block form found from the float32 values
        d64 = (torch.rand(n, k // 64, generator=g) * 0.01 + 0.001).half().float()
        z64 = torch.randint(0, 16, (n, k // 64), generator=g, dtype=torch.int32).to(torch.uint8)
        forms[name] = dict(float=w_float, q41_old=q41, q41=pack_int_weight(codes, d32, m32, 4, 32),
                           g64=pack_int_weight(codes, d64, z64, 4, 64))
    header = ["rows", "float32 panels", "Q4_1 float32 on its grid", "Q4_1 exact", "Q4_1 int8", "int4 g64 exact", "int4 g64 int8"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for m in rows:
        xs = {name: torch.randn(m, k, generator=g) for name, (n, k) in SHAPES.items()}
        flops = sum(2 * m * n * k for n, k in SHAPES.values())

        def run(kind: str, compute: str | None = None):
            def step():
                for name in SHAPES:
                    f = forms[name][kind]
                    if compute is None:
                        linear(xs[name], f)
                    else:
                        int_matmul(xs[name], f, compute)
            return flops / _time(step) / 1e9

        cells = [run("float"), run("q41_old"), run("q41", "exact"), run("q41", "int8"), run("g64", "exact"), run("g64", "int8")]
        print(f"| {m} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
