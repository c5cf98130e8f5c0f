"""The front end's cost per streamed token, and how it grows with the stream's length.

    python -m benchmarks.output_processing --streams 200 --tokens 2000

`--streams` requests each gain one token a step for `--tokens` steps, fed to the front end's
`OutputProcessor` as the core's messages, then through the server's per-choice streaming state
(`ChoiceStream`), exactly as `AsyncLLMEngine` and the SSE handlers do (no model, no HTTP). Two
ways, in the same run:

- `delta`: what the server does now: DELTA outputs (only what is new; stop-string prefixes held
  back in the output processor);
- `cumulative`: the way it was done before (the baseline): CUMULATIVE outputs, each copying every
  sample's token list, diffed back into deltas by slicing (the former `ChoiceStream.delta`).

Prints microseconds per token over the first and the last 10% of the steps (flat = O(L) per
stream, growing = O(L^2)) and the whole run's CPU seconds, median of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


class _CumulativeToDelta:
    """The former streaming-side differ: cumulative output -> (new text, new ids, logprobs)."""

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.sent_chars, self.sent_tokens = stop, 0, 0

    def delta(self, out):
        from pagedllm.tokenizer import num_held_back_chars

        text = out.text
        visible = len(text)
        if out.finish_reason is None and self.stop:
            visible -= num_held_back_chars(text, self.stop)
        new_text = text[self.sent_chars:visible] if visible > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, visible)
        end = len(out.token_ids)
        new_ids = list(out.token_ids[self.sent_tokens:end])
        self.sent_tokens = end
        return new_text, new_ids, None


def run(tok, mode: str, streams: int, tokens: int, seed: int = 0) -> dict:
    from pagedllm.engine.core_messages import EngineCoreOutput, SampleDelta
    from pagedllm.engine.output_processor import OutputProcessor
    from pagedllm.entrypoints.openai.streaming import ChoiceStream
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random(seed)
    kind = RequestOutputKind.DELTA if mode == "delta" else RequestOutputKind.CUMULATIVE
    stop = ["<|never|>"]  # a stop string, as chat requests often have: hold-back runs
    params = SamplingParams(max_tokens=tokens, output_kind=kind, stop=stop, ignore_eos=True)
    proc = OutputProcessor(tok)
    choices = {}
    for i in range(streams):
        proc.add_request(f"r{i}", None, [1, 2, 3], params, arrival_time=0.0)
        choices[f"r{i}"] = ChoiceStream() if mode == "delta" else _CumulativeToDelta(stop)
    vocab = [rng.randrange(300, 40000) for _ in range(4096)]
    per_step = []
    cpu0 = time.process_time()
    for step in range(tokens):
        last = step == tokens - 1
        batch = [EngineCoreOutput(f"r{i}", [SampleDelta(0, [vocab[(i * 7 + step) % 4096]],
                                                        finish_reason="length" if last else None)],
                                  finished=last) for i in range(streams)]
        t = time.perf_counter()
        processed = proc.process_outputs(batch, now=float(step))
        sent = 0
        for rid, out in processed.request_outputs:
            for c in out.outputs:
                text, ids, _ = choices[rid].delta(c)
                sent += len(ids)
        per_step.append(time.perf_counter() - t)
    cpu = time.process_time() - cpu0
    k = max(1, tokens // 10)
    return {"first_us_per_token": statistics.fmean(per_step[:k]) / streams * 1e6,
            "last_us_per_token": statistics.fmean(per_step[-k:]) / streams * 1e6,
            "cpu_s": cpu}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from pagedllm.model_source import resolve_model
    from pagedllm.tokenizer import load_tokenizer

    src = resolve_model(args.model)
    tok = load_tokenizer(src.path, src.gguf_file)
    result: dict = {"streams": args.streams, "tokens": args.tokens}
    for mode in ("cumulative", "delta"):
        runs = [run(tok, mode, args.streams, args.tokens, seed=r) for r in range(args.repeats)]
        result[mode] = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    result["cpu_ratio_cumulative_over_delta"] = round(
        result["cumulative"]["cpu_s"] / result["delta"]["cpu_s"], 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
