"""Incremental detokenization cost per engine step: `--batch-size` sequences each add one
token a step (the engine's per-step detokenizer work), median of `--repeats` runs of 20 steps.

    python -m benchmarks.detokenize --batch-size 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    from pagedllm.model_source import resolve_model
    from pagedllm.tokenizer import IncrementalDetokenizer, load_tokenizer

    src = resolve_model(args.model)
    tok = load_tokenizer(src.path, src.gguf_file)
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(args.batch_size)]
    runs = []
    for _ in range(args.repeats):
        dets = [IncrementalDetokenizer(tok, [1, 2, 3, 4, 5, 6, 7]) for _ in ids]
        t = time.perf_counter()
        for step in range(args.steps):
            for det, i in zip(dets, ids):
                det.add_token((i + 7 * step) % 40000 + 100)
        runs.append((time.perf_counter() - t) / args.steps * 1000)
    result = {"batch_size": args.batch_size, "ms_per_step": round(statistics.median(runs), 3),
              "runs_ms_per_step": [round(r, 3) for r in runs]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
