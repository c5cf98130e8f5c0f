"""Chart of benchmarks/multimodal_cache.py's JSON lines: per measurement, the median request time
split into image processing, vision encoder and the rest (prefill and engine), one panel per file.

    python -m benchmarks.multimodal_cache_plot results/a.jsonl [results/b.jsonl ...] --out chart.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.multimodal_cache import ORDER

LABELS = {"a_miss": "a: miss", "b_same": "b: same\nrequest", "c_text_before": "c: other text\nbefore image",
          "c_text_after": "c': other text\nafter image", "d_other_image": "d: same text,\nother image"}


def medians(path: str) -> dict[str, dict[str, float]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = {}
    for name in ORDER:
        mine = [r for r in rows if r.get("measure") == name]
        if not mine:
            raise ValueError(f"{path} has no {name!r} rows (not a multimodal_cache JSON lines file?)")
        out[name] = {k: statistics.median(r[k] for r in mine)
                     for k in ("seconds", "processing_s", "encoder_s", "num_cached_tokens", "prompt_tokens")}
    return out


def plot(paths: list[str], out: str, title: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(6.5 * len(paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], paths):
        med = medians(path)
        x = range(len(ORDER))
        proc = [med[n]["processing_s"] for n in ORDER]
        enc = [med[n]["encoder_s"] for n in ORDER]
        rest = [med[n]["seconds"] - p - e for n, p, e in zip(ORDER, proc, enc)]
        ax.bar(x, proc, label="image processing", color="#999999")
        ax.bar(x, enc, bottom=proc, label="vision encoder", color="#d95f02")
        ax.bar(x, rest, bottom=[p + e for p, e in zip(proc, enc)], label="prefill + engine", color="#1b9e77")
        first = med["a_miss"]["seconds"]
        for i, n in enumerate(ORDER):
            m = med[n]
            ax.text(i, m["seconds"], f"{m['seconds']:.2f} s\n{m['seconds'] / first:.2f}x\n"
                    f"{m['num_cached_tokens']:.0f}/{m['prompt_tokens']:.0f} cached", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), [LABELS[n] for n in ORDER], fontsize=8)
        ax.set_ylabel("seconds to the first token (median)")
        ax.set_ylim(0, first * 1.6)
        ax.set_title(Path(path).stem, fontsize=9)
        ax.legend(fontsize=8, loc="upper center", ncols=3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("jsonl", nargs="+")
    p.add_argument("--out", default="multimodal_cache.png")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    print(plot(args.jsonl, args.out, args.title))


if __name__ == "__main__":
    main()
