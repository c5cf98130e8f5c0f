"""What the encoder cache and the image-keyed prefix cache save (issue 45), on a mid-size random
LLaVA 1.5 (benchmarks/mm_checkpoint.py: CLIP ViT-B/14-like tower at 336 px = 576 image tokens,
SmolLM2-135M-shaped text model), one request at a time, max_tokens=1 (time to first token).

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.multimodal_cache --repeats 3 --batch 16

Prompt layout: "<context paragraph>\\nUSER: <image>\\n<question> ASSISTANT:" (the image in the
middle, LLaVA 1.5's "USER: <image>\\n..." after a system-like context), so that text can differ
either before the image or after it. Each repeat resets the prefix cache and draws FRESH images
A and B (640x480, resized and cropped by the processor), then runs, in order:

  a_miss         context 0 + A + question 0: nothing cached (processing + encoder + full prefill)
  b_same         the same again: every full prompt block from the prefix cache, no encoder work
  c_text_before  context 1 + A + question 0: text differs from the first token, so no prefix
                 block is shared, but A's rows come from the encoder cache (full prefill, no encoder)
  c_text_after   context 0 + A + question 1: the blocks up to the question are shared (the last
                 one holding the image's end is prefilled again: its rows hit the encoder cache)
  d_other_image  context 0 + B + question 0: only the blocks before the image are shared; B is
                 encoded and everything from the image on is prefilled

Then `--batch` distinct fresh images in one generate call (context 0, question 0, prefix cache
reset first): images per second through the engine, and through the encoder alone.

Per request: wall seconds, the front end's image processing and the vision encoder's seconds
(timers wrapped around `MultiModalProcessor.process` and the model's `embed_multimodal`; the
engine core runs in this process), `num_cached_tokens`, and the deltas of the scheduler's
encoder counters (images_encoded / hits / queries). One JSON line per measurement, then a table
of medians with the ratio to a_miss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTEXTS = (
    "You are the cataloguing assistant of a small regional museum. Visitors send photographs of objects "
    "from the collection and ask about them. Answer in two or three short sentences, name the colours you "
    "see, say how the parts are arranged, and never guess a date or a maker that the picture does not show. "
    "If the picture is unclear, say so plainly and suggest what a better photograph would include.",
    "Field notes, day twelve of the survey. The team photographs every plot at noon from the same corner "
    "post, so that the light is comparable between days. Each frame is checked for standing water, bare "
    "soil, and any new growth along the transect line. Describe only what is visible in the frame, list "
    "the regions from left to right, and keep the description under fifty words in plain language.",
)
QUESTIONS = ("What is shown in this picture? Describe the colours and the shapes.",
             "How many separate blocks of colour are there, and where are they?")
ORDER = ("a_miss", "b_same", "c_text_before", "c_text_after", "d_other_image")
LAYOUT = {"a_miss": (0, "A", 0), "b_same": (0, "A", 0), "c_text_before": (1, "A", 0),
          "c_text_after": (0, "A", 1), "d_other_image": (0, "B", 0)}


def prompt(context: int, question: int) -> str:
    return f"{CONTEXTS[context]}\nUSER: <image>\n{QUESTIONS[question]} ASSISTANT:"


class Timers:
    """Seconds spent in the front end's image processing and in the vision encoder, wrapped
    around the engine's own objects (the offline engine's core runs in this process)."""

    def __init__(self, llm) -> None:
        self.seconds = {"processing_s": 0.0, "encoder_s": 0.0}
        engine = llm.llm_engine
        self._wrap(engine.inputs.multimodal, "process", "processing_s")
        self._wrap(engine.core.model_runner.mm_embeddings.model, "embed_multimodal", "encoder_s")

    def _wrap(self, obj: Any, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t

        object.__setattr__(obj, name, timed)

    def take(self) -> dict[str, float]:
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out


def counters(llm) -> dict[str, int]:
    enc = llm.llm_engine.core.scheduler.encoder_cache
    return {"images_encoded": enc.images_encoded, "hits": enc.hits, "queries": enc.queries}


def run(llm, timers: Timers, prompts: list[dict], params) -> tuple[float, list, dict[str, int], dict[str, float]]:
    """(wall seconds, outputs, encoder counter deltas, processing/encoder seconds) of one generate call."""
    before = counters(llm)
    timers.take()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    after = counters(llm)
    return wall, outs, {k: after[k] - before[k] for k in after}, timers.take()


def images(n: int, seed: int) -> list:
    from tests.integration.vlm_fixtures import sample_images

    return sample_images(n, seed=seed, size=(640, 480))


def one_repeat(llm, timers: Timers, params, repeat: int, emit) -> None:
    llm.reset_prefix_cache()
    a, b = images(2, seed=1000 + repeat)
    pics = {"A": a, "B": b}
    for name in ORDER:
        ctx, pic, q = LAYOUT[name]
        wall, (out,), delta, secs = run(llm, timers, [{"prompt": prompt(ctx, q),
                                                       "multi_modal_data": {"image": [pics[pic]]}}], params)
        ids = list(out.prompt_token_ids)
        image_id = llm.llm_engine.inputs.multimodal.image_token_id
        emit({"measure": name, "repeat": repeat, "seconds": round(wall, 4), **secs,
              "prompt_tokens": len(ids), "image_start": ids.index(image_id), "image_tokens": ids.count(image_id),
              "num_cached_tokens": out.num_cached_tokens, **delta})


def batch_repeat(llm, timers: Timers, params, n: int, repeat: int, emit) -> None:
    llm.reset_prefix_cache()
    prompts = [{"prompt": prompt(0, 0), "multi_modal_data": {"image": [im]}} for im in images(n, seed=2000 + repeat)]
    wall, outs, delta, secs = run(llm, timers, prompts, params)
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    emit({"measure": f"batch{n}", "repeat": repeat, "seconds": round(wall, 4), **secs, "images": n,
          "images_per_s": round(n / wall, 3), "encoder_images_per_s": round(n / secs["encoder_s"], 3),
          "prompt_tokens": tokens, "num_cached_tokens": cached,
          "prefill_tok_per_s": round((tokens - cached) / wall, 1), **delta})


def summary(rows: list[dict], batch: int) -> str:
    med = lambda name, key: statistics.median(r[key] for r in rows if r["measure"] == name)  # noqa: E731
    first = med("a_miss", "seconds")
    lines = [f"{'measure':14} {'median s':>9} {'/a_miss':>8} {'proc s':>7} {'enc s':>7} {'prompt':>6} "
             f"{'cached':>6} {'encoded':>7} {'hits':>4} {'queries':>7}  (medians of "
             f"{sum(r['measure'] == 'a_miss' for r in rows)})"]
    for name in ORDER:
        s = med(name, "seconds")
        lines.append(f"{name:14} {s:9.3f} {s / first:8.3f} {med(name, 'processing_s'):7.3f} "
                     f"{med(name, 'encoder_s'):7.3f} {med(name, 'prompt_tokens'):6.0f} {med(name, 'num_cached_tokens'):6.0f} "
                     f"{med(name, 'images_encoded'):7.0f} {med(name, 'hits'):4.0f} {med(name, 'queries'):7.0f}")
    b = f"batch{batch}"
    if any(r["measure"] == b for r in rows):
        lines.append(f"{b}: median {med(b, 'seconds'):.3f} s = {med(b, 'images_per_s'):.2f} images/s through the "
                     f"engine (prefill {med(b, 'prefill_tok_per_s'):.0f} tok/s); vision encoder alone "
                     f"{med(b, 'encoder_s'):.3f} s = {med(b, 'encoder_images_per_s'):.2f} images/s; "
                     f"image processing {med(b, 'processing_s'):.3f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a LLaVA folder (default: benchmarks/mm_checkpoint.py's, built once)")
    p.add_argument("--image-size", type=int, default=336, help="of the built checkpoint: 224 (256 tokens) or 336 (576)")
    p.add_argument("--vision-hidden", type=int, default=768)
    p.add_argument("--vision-layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="distinct images in the throughput batch (0: skip)")
    p.add_argument("--json-out", default=None, help="append the JSON lines to this file")
    args = p.parse_args(argv)

    from benchmarks.mm_checkpoint import checkpoint, parameter_counts, vision_shape
    from pagedllm import LLM, SamplingParams

    model = args.model or str(checkpoint(vision_shape(args.image_size, args.vision_hidden, args.vision_layers)))
    rows: list[dict] = []
    sink = open(args.json_out, "a") if args.json_out else None

    def emit(row: dict) -> None:
        row = {"bench": "multimodal_cache", **row}
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")

    import torch

    t = time.perf_counter()
    llm = LLM(model=model)
    emit({"measure": "startup", "seconds": round(time.perf_counter() - t, 2), "model": model,
          "params": parameter_counts(__import__("pathlib").Path(model)), "torch_threads": torch.get_num_threads()})
    timers = Timers(llm)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # Warm-up (kernels, first-call paths), then nothing it cached is reused: other images, reset.
    warm = images(3, seed=999)
    run(llm, timers, [{"prompt": prompt(0, 0), "multi_modal_data": {"image": [warm[0]]}}], params)
    run(llm, timers, [{"prompt": prompt(1, 1), "multi_modal_data": {"image": [im]}} for im in warm[1:]], params)
    for r in range(args.repeats):
        one_repeat(llm, timers, params, r, emit)
    if args.batch:
        for r in range(args.repeats):
            batch_repeat(llm, timers, params, args.batch, r, emit)
    if sink:
        sink.close()
    print(summary(rows, args.batch), file=sys.stdout, flush=True)
    return rows


if __name__ == "__main__":
    main()
