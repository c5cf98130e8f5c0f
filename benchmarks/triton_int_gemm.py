"""GPU benchmark (needs CUDA and triton): the Triton dequantize-fused int4 / int8 matmul
(`pagedllm/quantization/kernels/triton_int_gemm.py`) against torch's float16 matmul of the
already-dequantized weight (the float16 layer it replaces) and against the portable path
(dequantize in torch on every call, then matmul: what `apply` ran before).

  python -m benchmarks.triton_int_gemm                       # M = 1, 16, 256; K = N = 4096
  python -m benchmarks.triton_int_gemm --m 1 4 --k 4096 --n 11008 --bits 4 --group-size 128 --json out.jsonl

Each line: time per call (median of triton.testing.do_bench), effective GB/s (bytes the kernel
must move: packed weight, scales, zeros, x, y; for the float16 matmul its 2-byte weight) and
TFLOP/s (2*M*N*K). Decode (M = 1..16) is bandwidth-bound: an int4 kernel moving ~3.6x fewer
bytes than float16 should beat the float16 matmul there; at M = 256 it is compute-bound and the
in-register dequantization costs. Every configuration is checked against a float64 product
first (relative error printed), so a fast wrong kernel cannot pass unnoticed.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _weight(K, N, bits, gs, device, seed=0):
    from pagedllm.quantization.formats.packing import pack_int32

    g = torch.Generator().manual_seed(seed)
    groups = K // (K if gs == -1 else gs)
    codes = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 1 << bits, (groups, N), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = ((torch.rand(groups, N, generator=g) - 0.5) * (0.04 / (1 << bits))).half()
    return pack_int32(codes, bits, 0).to(device), scales.to(device), zeros.to(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--act-order", action="store_true", help="also gather x by a random permutation")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--json", help="append one JSON line per configuration to this file")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("benchmarks/triton_int_gemm.py needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    from pagedllm.quantization.kernels import triton_int_gemm as tig
    from pagedllm.quantization.formats.packing import dequantize

    if not tig.HAS_TRITON:
        print("benchmarks/triton_int_gemm.py needs triton (pip install triton)", file=sys.stderr)
        return 2
    import triton.testing

    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    K, N, gs = args.k, args.n, args.group_size
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}, triton {triton.__version__}; "
          f"K={K} N={N} group_size={gs} x {args.dtype}")
    print(f"{'bits':>4} {'M':>5} {'path':<22} {'us':>9} {'GB/s':>8} {'TFLOP/s':>8} {'vs fp16':>8} {'rel err':>9}")
    rows = []
    for bits in args.bits:
        qweight, scales, zeros = _weight(K, N, bits, gs, dev)
        gse = K if gs == -1 else gs
        w32 = dequantize(qweight, scales, zeros, bits, gse)
        w16 = w32.to(dtype)
        perm = torch.randperm(K, device=dev) if args.act_order else None
        packed_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
        for M in args.m:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            xp = x if perm is None else x.index_select(-1, perm)
            ref = (xp.double() @ w16.double())
            y = tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs, perm)
            torch.cuda.synchronize()
            rel = float((y.double() - ref).abs().max() / ref.abs().max())
            io_bytes = (M * K + M * N) * x.element_size()
            flops = 2 * M * N * K

            def portable():
                xx = x if perm is None else x.index_select(-1, perm)
                return xx @ dequantize(qweight, scales, zeros, bits, gse).to(dtype)

            paths = [
                ("torch fp16 matmul" if dtype == torch.float16 else "torch bf16 matmul",
                 lambda: x @ w16, w16.numel() * 2 + io_bytes, 0.0),
                (f"triton int{bits}", lambda: tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs, perm),
                 packed_bytes + io_bytes, rel),
                ("portable (deq+matmul)", portable, packed_bytes + io_bytes, 0.0),
            ]
            base = None
            for name, fn, nbytes, err in paths:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                base = base or ms
                row = dict(bits=bits, M=M, K=K, N=N, group_size=gs, act_order=args.act_order, path=name,
                           us=ms * 1e3, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9, speedup_vs_fp16=base / ms,
                           rel_err=err)
                rows.append(row)
                print(f"{bits:>4} {M:>5} {name:<22} {row['us']:>9.1f} {row['gbps']:>8.0f} {row['tflops']:>8.2f} "
                      f"{row['speedup_vs_fp16']:>7.2f}x {err:>9.2e}")
            if rel > 1e-2:
                print(f"  WRONG: triton int{bits} M={M} relative error {rel:.3g}", file=sys.stderr)
                return 1
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
