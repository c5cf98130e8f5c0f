"""The batched LoRA ops (lora/ops.py, kernels/lora.c) against torch on this machine, on
SmolLM2-135M's projections: microseconds per call and the ratio best-torch / C (above 1: the C
kernel is faster).

Torch candidates, all in the same process and run (the best of them is the baseline):
- `ref`: the package's own torch fallback (`lora_shrink_reference` / `lora_expand_reference`);
- `bmm`: per-token gather of A / B and `torch.bmm` (skipped where the gathered copy would
  exceed 256 MB);
- `seg`: one `mm` per adapter segment, tokens grouped beforehand (not timed: a step's grouping
  serves every layer), a plain `mm` / `addmm_` without gathers when one adapter holds the batch.
The C columns call the library of each variant directly (`shrink_c` / `expand_c`, the
ctypes call included); `op` is the public `lora_shrink` / `lora_expand` (validation included,
and torch's GEMM where the op takes it: one slot for the whole batch from
`ops.SINGLE_SLOT_TORCH_MIN_TOKENS` tokens). Each figure: median of 5 timed loops (each >= 2 ms) after a warm-up.
Adapters: `1` (every token one adapter) or `4` (each token a random one of 4: runs of about one
token, the kernel's worst case). max_loras 4 slots.

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.lora_ops [--variants avx512-vnni-bf16,avx2,portable]
        [--tokens 1,4,16,64,512] [--ranks 8,16,64] [--full]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pagedllm.kernels import lora_kernel
from pagedllm.kernels.isa import runnable_variants
from pagedllm.lora import ops

# name: (K of the shrink, slice sizes of the expand)
LAYERS = {"qkv": (576, [576, 192, 192]), "o": (576, [576]), "gate_up": (576, [1536, 1536]), "down": (1536, [576])}
SLOTS = 4
GATHER_LIMIT = 256 << 20


def _time(fn: Callable[[], object], min_s: float = 0.002) -> float:
    """Median microseconds per call of 5 loops of at least `min_s` each, after a warm-up."""
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, int(min_s / max(time.perf_counter() - t0, 1e-7)))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples) * 1e6


def _groups(idx: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """(slot, its tokens; None when it holds every token) of each adapter used."""
    slots = [int(s) for s in torch.unique(idx) if s >= 0]
    if len(slots) == 1 and bool((idx == slots[0]).all()):
        return [(slots[0], None)]
    return [(s, torch.nonzero(idx == s)[:, 0]) for s in slots]


def _torch_shrink(x, a, idx, groups) -> dict[str, Callable[[], object]]:
    T, K = x.shape
    valid = (idx >= 0)[:, None, None]
    slot = idx.long().clamp(min=0)

    def seg():
        if groups[0][1] is None:
            return x @ a[groups[0][0]].T
        out = x.new_zeros(T, a.shape[1])
        for s, tok in groups:
            out.index_copy_(0, tok, x.index_select(0, tok) @ a[s].T)
        return out

    cands = {"ref": lambda: ops.lora_shrink_reference(x, a, idx), "seg": seg}
    if T * a.shape[1] * K * 4 <= GATHER_LIMIT:
        cands["bmm"] = lambda: (torch.bmm(a[slot], x[:, :, None]) * valid)[:, :, 0]
    return cands


def _torch_expand(buf, b, idx, y, sizes, groups) -> dict[str, Callable[[], object]]:
    T, R = buf.shape[0], b.shape[2]
    slot = idx.long().clamp(min=0)
    masked = buf * (idx >= 0)[:, None]

    def seg():
        row = 0
        for i, n in enumerate(sizes):
            for s, tok in groups:
                w = b[s, row:row + n].T
                if tok is None:
                    y[:, row:row + n].addmm_(buf[:, i * R:(i + 1) * R], w)
                else:
                    y[:, row:row + n].index_add_(0, tok, buf[tok, i * R:(i + 1) * R] @ w)
            row += n

    def bmm():
        row = 0
        for i, n in enumerate(sizes):
            y[:, row:row + n] += torch.bmm(b[slot, row:row + n], masked[:, i * R:(i + 1) * R, None])[:, :, 0]
            row += n

    cands = {"ref": lambda: ops.lora_expand_reference(buf, b, idx, y, sizes), "seg": seg}
    if T * b.shape[1] * R * 4 <= GATHER_LIMIT:
        cands["bmm"] = bmm
    return cands


def run(variants: list[str], tokens: list[int], ranks: list[int]) -> list[dict]:
    kernels = {v: lora_kernel(v) for v in variants}
    missing = [v for v, k in kernels.items() if k is None]
    if missing:
        raise SystemExit(f"no lora.c library for {missing} (no compiler, or the CPU cannot run them)")
    g = torch.Generator().manual_seed(0)
    rows = []
    for layer, (K, sizes) in LAYERS.items():
        N = sum(sizes)
        for rank in ranks:
            Rt = len(sizes) * rank
            a = torch.randn(SLOTS, Rt, K, generator=g) * 0.05
            b = torch.randn(SLOTS, N, rank, generator=g) * 0.05
            for T in tokens:
                for adapters in (1, 4):
                    if T == 1 and adapters > 1:
                        continue
                    idx = (torch.full((T,), 1, dtype=torch.int32) if adapters == 1 else
                           torch.randint(0, adapters, (T,), generator=g, dtype=torch.int32))
                    groups = _groups(idx)
                    x = torch.randn(T, K, generator=g)
                    buf = torch.randn(T, Rt, generator=g)
                    y = torch.zeros(T, N)
                    out = torch.empty(T, Rt)
                    for op, cands, c_call, public in (
                        ("shrink", _torch_shrink(x, a, idx, groups),
                         lambda k: ops.shrink_c(k, x, a, idx, out), lambda: ops.lora_shrink(x, a, idx, out)),
                        ("expand", _torch_expand(buf, b, idx, y, sizes, groups),
                         lambda k: ops.expand_c(k, buf, b, idx, y, sizes),
                         lambda: ops.lora_expand(buf, b, idx, y, sizes)),
                    ):
                        torch_us = {name: _time(fn) for name, fn in cands.items()}
                        c_us = {v: _time(lambda k=k: c_call(k)) for v, k in kernels.items()}
                        rows.append(dict(op=op, layer=layer, rank=rank, T=T, adapters=adapters, torch=torch_us,
                                         c=c_us, public=_time(public)))
                        print(_full_row(rows[-1], variants), flush=True)
    return rows


def _full_row(r: dict, variants: list[str]) -> str:
    best = min(r["torch"], key=r["torch"].get)
    t = r["torch"][best]
    cells = [f"{r['c'][v]:.1f} ({t / r['c'][v]:.2f}x)" for v in variants]
    torch_cells = " / ".join(f"{k} {v:.1f}" for k, v in sorted(r["torch"].items()))
    return (f"| {r['op']} | {r['layer']} | {r['rank']} | {r['T']} | {r['adapters']} | {torch_cells} | {best} | "
            + " | ".join(cells) + f" | {r['public']:.1f} |")


def full_header(variants: list[str]) -> str:
    return ("| op | layer | rank | T | adapters | torch us (bmm / ref / seg) | best torch | "
            + " | ".join(f"{v} us (x best torch)" for v in variants) + " | op us |\n|"
            + "---|" * (8 + len(variants)))


def summary(rows: list[dict], variants: list[str]) -> str:
    """Per op, tokens and adapters: the ratio best-torch / C, min-max over the 4 layers x ranks;
    the last column the public op's (its checks included, and torch's GEMM where it takes it)."""
    lines = ["| op | T | adapters | best torch us (min-max) | " + " | ".join(f"{v}: x best torch" for v in variants)
             + " | op: x best torch |", "|" + "---|" * (5 + len(variants))]
    keys = sorted({(r["op"], r["T"], r["adapters"]) for r in rows}, key=lambda k: (k[0] != "shrink", k[1], k[2]))
    for op, T, adapters in keys:
        sel = [r for r in rows if (r["op"], r["T"], r["adapters"]) == (op, T, adapters)]
        best = [min(r["torch"].values()) for r in sel]
        cells = []
        for v in variants:
            ratios = [min(r["torch"].values()) / r["c"][v] for r in sel]
            cells.append(f"{min(ratios):.2f}-{max(ratios):.2f}x")
        ratios = [min(r["torch"].values()) / r["public"] for r in sel]
        cells.append(f"{min(ratios):.2f}-{max(ratios):.2f}x")
        lines.append(f"| {op} | {T} | {adapters} | {min(best):.1f}-{max(best):.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = [runnable_variants()[0].name] + [v for v in ("avx2", "portable")
                                               if v in {r.name for r in runnable_variants()}]
    parser.add_argument("--variants", default=",".join(dict.fromkeys(default)))
    parser.add_argument("--tokens", default="1,4,16,64,512")
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--full", action="store_true", help="print only the per-shape table (no summary)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; variants {variants}\n")
    print(full_header(variants))
    rows = run(variants, [int(t) for t in args.tokens.split(",")], [int(r) for r in args.ranks.split(",")])
    if not args.full:
        print("\n" + summary(rows, variants))


if __name__ == "__main__":
    main()
