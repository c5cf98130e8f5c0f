"""Every instruction-set variant of the C kernels (kernels/isa.py) on this machine, against
torch's own ops in the same process: GFLOP/s per SmolLM2-135M projection shape and batch, and
the attention kernels' time against the torch path.

Each variant runs in a child process with `PAGEDLLM_KERNEL_MARCH=<variant>`, through the code the
engine runs (layers/linear.py's prepared weights, int_kernel.int_matmul, the attention ops), so
an AVX2 build is measured natively on an AVX-512 machine. Columns (GFLOP/s, ratio to torch):
- `torch`: `F.linear` on the float32 weight (the baseline of every ratio);
- `f32`: packed_gemm.c on that weight's panels;
- `q4_1 exact` / `q4_1 int8`: int_gemm.c on Q4_1-like blocks (g32, float m), exact float32
  arithmetic / int8 activations; `g64 exact` / `g64 int8`: int4 groups of 64 with zero points.
The attention rows give microseconds per call, C kernel against the torch path (gather + SDPA),
decode over 256 cached tokens per sequence, prefill of `batch` new tokens in one sequence.
Medians of 3 timed loops (each at least 30 ms), after a warm-up.

    python -m benchmarks.kernel_matrix [--variants avx2,avx512-vnni-bf16] [--batches 1,8,20,128,512]
    python -m benchmarks.kernel_matrix --summary rows.jsonl   # compact per-variant ratio ranges
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LINEAR_COLUMNS = ["torch", "f32", "q4_1 exact", "q4_1 int8", "g64 exact", "g64 int8"]


def _time(fn, min_s: float = 0.03) -> float:
    """Median seconds per call over 3 loops of at least `min_s` each."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(min_s / once))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def _child(batches: list[int]) -> None:
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels.status import kernel_status
    from pagedllm.layers.linear import linear_prepared, prepare_weight
    from pagedllm.quantization.kernels.int_kernel import int_gemm_isa, int_matmul, pack_int_weight, unpack_int_weight

    report = kernel_status()
    try:
        from pagedllm.kernels.isa import select_variant

        variant = getattr(select_variant().variant, "name", None)
    except ImportError:  # a tree from before kernels/isa.py (a "before" run): the -march given
        variant = "march=" + os.environ.get("PAGEDLLM_KERNEL_MARCH", "native")
    print(json.dumps({"variant": variant, "isa": int_gemm_isa(),
                      "active": report.active_names, "threads": torch.get_num_threads()}), flush=True)
    g = torch.Generator().manual_seed(0)
    forms = {}
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
        d32 = (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).half().float()
        m32 = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
        d64 = (torch.rand(n, k // 64, generator=g) * 0.01 + 0.001).half().float()
        z64 = torch.randint(0, 16, (n, k // 64), generator=g, dtype=torch.int32).to(torch.uint8)
        q41 = pack_int_weight(codes, d32, m32, 4, 32)
        w = unpack_int_weight(q41)  # the float32 weight the Q4_1 form stands for
        forms[name] = dict(w=w, wf=torch.randn(n, k, generator=g) * 0.05, q41=q41,
                           g64=pack_int_weight(codes, d64, z64, 4, 64))
        wf = forms[name]["wf"]
        forms[name]["prepared"] = prepare_weight(wf)
        assert forms[name]["prepared"].packed is not None, "a random weight must take the float panels"
    for m in batches:
        for name, (n, k) in SHAPES.items():
            f = forms[name]
            x = torch.randn(m, k, generator=g)
            flops = 2 * m * n * k
            cells = {
                "torch": lambda: F.linear(x, f["wf"]),
                "f32": lambda: linear_prepared(x, f["wf"], None, f["prepared"]),
                "q4_1 exact": lambda: int_matmul(x, f["q41"], "exact"),
                "q4_1 int8": lambda: int_matmul(x, f["q41"], "int8"),
                "g64 exact": lambda: int_matmul(x, f["g64"], "exact"),
                "g64 int8": lambda: int_matmul(x, f["g64"], "int8"),
            }
            # correctness first: a fast wrong kernel must not reach the table
            ref = F.linear(x, f["wf"])
            assert torch.allclose(cells["f32"](), ref, rtol=1e-4, atol=1e-4), (name, m, "f32")
            ref41 = F.linear(x, f["w"])
            assert torch.allclose(cells["q4_1 exact"](), ref41, rtol=1e-4, atol=1e-3), (name, m, "exact")
            gf = {c: flops / _time(fn) / 1e9 for c, fn in cells.items()}
            print(json.dumps({"kind": "linear", "shape": name, "batch": m, **gf}), flush=True)
    _attention_rows(batches, g)


def _attention_rows(batches: list[int], g) -> None:
    import torch

    from pagedllm.layers.attention import AttentionMetadata
    from pagedllm.layers.backends.decode_op import decode_attention_c, decode_attention_torch
    from pagedllm.layers.backends.prefill_op import prefill_attention_c
    from pagedllm.layers.backends.torch_paged import TorchPagedAttentionBackend

    hq, hk, dh, bs, ctx = 9, 3, 64, 16, 256
    for m in batches:
        blocks_per_seq = ctx // bs
        nb = m * blocks_per_seq + 1
        kc = torch.randn(nb, bs, hk, dh, generator=g)
        vc = torch.randn(nb, bs, hk, dh, generator=g)
        tables = torch.randperm(nb - 1, generator=g)[: m * blocks_per_seq].view(m, blocks_per_seq)
        lens = torch.full((m,), ctx)
        q = torch.randn(m, hq, dh, generator=g)
        want = decode_attention_torch(q, kc, vc, tables, lens, dh**-0.5, None)
        got = decode_attention_c(q, kc, vc, tables, lens, dh**-0.5, None)
        row = {"kind": "decode attention", "batch": m,
               "torch_us": _time(lambda: decode_attention_torch(q, kc, vc, tables, lens, dh**-0.5, None)) * 1e6}
        if got is not None:
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
            row["c_us"] = _time(lambda: decode_attention_c(q, kc, vc, tables, lens, dh**-0.5, None)) * 1e6
        print(json.dumps(row), flush=True)
    for m in batches:
        if m < 8:
            continue
        n = -(-m // bs)
        kc = torch.randn(n + 1, bs, hk, dh, generator=g)
        vc = torch.randn(n + 1, bs, hk, dh, generator=g)
        table = torch.arange(1, n + 1)
        md = AttentionMetadata(
            slot_mapping=torch.arange(bs, bs + m), block_size=bs, num_decode_tokens=0,
            decode_block_tables=None, decode_context_lens=None, prefill_query_starts=[0],
            prefill_query_lens=[m], prefill_context_lens=[m], prefill_block_tables=[table],
            prefill_block_tables_padded=table.view(1, -1))
        md_torch = AttentionMetadata(**{**md.__dict__, "prefill_block_tables_padded": None, "_mask_cache": {}})
        qkv = torch.randn(m, hq + 2 * hk, dh, generator=g)
        q, k, v = qkv.split([hq, hk, hk], dim=1)
        cache = torch.stack([kc, vc])

        def torch_path():
            return TorchPagedAttentionBackend.forward(q, k, v, cache, md_torch, dh**-0.5, None)

        row = {"kind": "prefill attention", "batch": m, "torch_us": _time(torch_path) * 1e6}
        got = prefill_attention_c(q, k, v, cache[0], cache[1], md, dh**-0.5, None)
        if got is not None:
            assert torch.allclose(got, torch_path(), rtol=1e-4, atol=1e-5)
            row["c_us"] = _time(lambda: prefill_attention_c(q, k, v, cache[0], cache[1], md, dh**-0.5, None)) * 1e6
        print(json.dumps(row), flush=True)


def _print_variant(head: dict, rows: list[dict], cpu: str) -> None:
    print(f"\n### variant `{head['variant']}` (int_gemm ISA {head['isa']}, {head['threads']} threads) on {cpu}\n")
    print("| shape | batch | " + " | ".join(LINEAR_COLUMNS) + " |")
    print("|---|---|" + "---|" * len(LINEAR_COLUMNS))
    for r in (r for r in rows if r["kind"] == "linear"):
        base = r["torch"]
        cells = [f"{base:.0f}"] + [f"{r[c]:.0f} ({r[c] / base:.2f}x)" for c in LINEAR_COLUMNS[1:]]
        print(f"| {r['shape']} | {r['batch']} | " + " | ".join(cells) + " |")
    att = [r for r in rows if r["kind"] != "linear"]
    if att:
        print("\n| attention | batch | torch path (us) | C kernel (us) | torch / C |")
        print("|---|---|---|---|---|")
        for r in att:
            c = r.get("c_us")
            print(f"| {r['kind']} | {r['batch']} | {r['torch_us']:.0f} | "
                  + (f"{c:.0f} | {r['torch_us'] / c:.2f}x |" if c else "off | - |"))


def summary(path: str) -> None:
    """Per variant and batch: the range over the four shapes of each column's ratio to torch,
    and the attention kernels' speed-up over the torch path (from a `--json` file)."""
    rows = [r for r in (json.loads(ln) for ln in open(path) if ln.strip()) if "kind" in r]
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        print(f"\n`{name}` on {mine[0].get('cpu', '?')}: ratio to torch (min-max over the 4 shapes)\n")
        print("| batch | torch GFLOP/s | " + " | ".join(LINEAR_COLUMNS[1:]) + " | decode attn | prefill attn |")
        print("|---|---|" + "---|" * (len(LINEAR_COLUMNS) + 1))
        for b in sorted({r["batch"] for r in mine if r.get("kind") == "linear"}):
            lin = [r for r in mine if r.get("kind") == "linear" and r["batch"] == b]
            torch_gf = f"{min(r['torch'] for r in lin):.0f}-{max(r['torch'] for r in lin):.0f}"
            cells = []
            for c in LINEAR_COLUMNS[1:]:
                ratios = [r[c] / r["torch"] for r in lin]
                cells.append(f"{min(ratios):.2f}-{max(ratios):.2f}x")
            for kind in ("decode attention", "prefill attention"):
                att = [r for r in mine if r.get("kind") == kind and r["batch"] == b and r.get("c_us")]
                cells.append(f"{att[0]['torch_us'] / att[0]['c_us']:.2f}x" if att else "-")
            print(f"| {b} | {torch_gf} | " + " | ".join(cells) + " |")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        model = "?"
    with open("/proc/cpuinfo") as f:
        flags = {w for ln in f if ln.startswith("flags") for w in ln.split(":", 1)[1].split()}
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile") if f in flags]
    return f"{model} ({' '.join(shown)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="", help="comma-separated variant names (default: every one this CPU runs)")
    p.add_argument("--batches", default="1,8,20,128,512")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help="also write every row as JSON lines to this file")
    p.add_argument("--summary", default="", help="print the compact tables of a --json file and exit")
    args = p.parse_args()
    if args.summary:
        summary(args.summary)
        return
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        _child(batches)
        return
    names = [v for v in args.variants.split(",") if v]
    if not names:
        from pagedllm.kernels.isa import runnable_variants

        names = [v.name for v in runnable_variants()]
    cpu = _cpu_name()
    out = open(args.json, "w") if args.json else None
    for name in names:
        env = dict(os.environ, PAGEDLLM_KERNEL_MARCH=name)
        proc = subprocess.run([sys.executable, "-m", "benchmarks.kernel_matrix", "--child", "--batches", args.batches],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"\n### variant `{name}`: failed\n```\n{proc.stderr[-2000:]}\n```")
            continue
        lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if out:
            for ln in lines:
                out.write(json.dumps({**ln, "variant": name, "cpu": cpu}) + "\n")
        _print_variant(lines[0], lines[1:], cpu)
    if out:
        out.close()


if __name__ == "__main__":
    main()
