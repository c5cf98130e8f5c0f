"""`RequestOutputKind` honoured: CUMULATIVE, DELTA and FINAL_ONLY outputs of the same token
deltas tell the same story. The output processor is fed the core's messages directly (random
token streams over SmolLM2's tokenizer, stop strings that cut them), and the offline engine
runs each kind on the real model."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from pagedllm.engine.core_messages import EngineCoreOutput, SampleDelta
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import load_tokenizer

GGUF_DIR = Path(os.environ.get("PAGEDLLM_TEST_GGUF_DIR", "~/.cache/pagedllm")).expanduser()
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (GGUF_DIR / GGUF_NAME).is_file(), reason=f"{GGUF_DIR / GGUF_NAME} not present"
)]

KINDS = list(RequestOutputKind)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(GGUF_DIR, gguf_file=GGUF_NAME)


def _run(tokenizer, kind: RequestOutputKind, steps: list[list[list[int]]], **params):
    """Feed `steps` (per step, per sample, the new token ids) to one request; the outputs."""
    n = len(steps[0])
    sp = SamplingParams(n=n, output_kind=kind, logprobs=0, **params)
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 2, 3], sp, arrival_time=0.0)
    outputs: list[RequestOutput] = []
    stats = []
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        deltas = [SampleDelta(j, ids, [(t, -0.5, 1, []) for t in ids],
                              finish_reason="length" if last else None)
                  for j, ids in enumerate(step) if ids or last]
        result = proc.process_outputs([EngineCoreOutput("r", deltas, finished=last)], now=i)
        outputs += [o for _, o in result.request_outputs]
        stats += result.step_stats
        if not proc.has_request("r"):
            break
    return outputs, stats


def _random_steps(rng: random.Random, text: str, tokenizer, n: int) -> list[list[list[int]]]:
    """Each sample's tokens of `text` shuffled a little, cut into steps of 0-3 tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    per_sample = []
    for _ in range(n):
        mine = list(ids)
        for _ in range(3):
            i, j = rng.randrange(len(mine)), rng.randrange(len(mine))
            mine[i], mine[j] = mine[j], mine[i]
        per_sample.append(mine)
    steps, pos = [], [0] * n
    while any(p < len(s) for p, s in zip(pos, per_sample)):
        step = []
        for j in range(n):
            k = rng.randrange(0, 4)
            step.append(per_sample[j][pos[j]:pos[j] + k])
            pos[j] += k
        steps.append(step)
    return steps


TEXTS = ["The quick brown fox jumps over the lazy dog. STOP here, then more text follows.",
         "Emoji 😀👍🏽 and 日本語 split across tokens; END of line\nnext line END again",
         "a, b, c, d, e, f, g, STO, STOP, h"]


@pytest.mark.parametrize("seed", range(12))
def test_deltas_concatenate_to_the_cumulative_output(tokenizer, seed):
    rng = random.Random(seed)
    text = TEXTS[seed % len(TEXTS)]
    steps = _random_steps(rng, text, tokenizer, n=1 + seed % 3)
    stop = [["STOP"], ["END", "xyz"], [], ["line\nnext"]][seed % 4]
    runs = {k: _run(tokenizer, k, steps, stop=stop) for k in KINDS}
    final = runs[RequestOutputKind.CUMULATIVE][0][-1]
    assert final.finished
    # FINAL_ONLY: one output, the cumulative one's last
    only, _ = runs[RequestOutputKind.FINAL_ONLY]
    assert len(only) == 1 and only[0].finished
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in only[0].outputs] == \
        [(c.index, c.text, c.token_ids, c.finish_reason) for c in final.outputs]
    # DELTA: per sample, the deltas add up to the final text, tokens and logprobs, and no
    # delta ever carries text that the final output does not have at that place
    deltas, _ = runs[RequestOutputKind.DELTA]
    for c in final.outputs:
        mine = [d for out in deltas for d in out.outputs if d.index == c.index]
        assert "".join(d.text for d in mine) == c.text
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert sum(len(d.logprobs) for d in mine) == len(c.logprobs)
        assert [d.finish_reason for d in mine].count(None) == len(mine) - 1
        assert mine[-1].finish_reason == c.finish_reason
    # a slow reader of DELTA outputs gets them folded into one: the same totals
    folded = deltas[0]
    for later in deltas[1:]:
        folded.add(later)
    assert [(c.index, c.text, c.token_ids) for c in folded.outputs] == \
        [(c.index, c.text, c.token_ids) for c in final.outputs]
    # the metrics see the same steps whatever the kind
    cum_stats = [(s.metrics.num_generation_tokens, s.longest, s.finished)
                 for s in runs[RequestOutputKind.CUMULATIVE][1]]
    for k in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        assert [(s.metrics.num_generation_tokens, s.longest, s.finished)
                for s in runs[k][1]] == cum_stats


def test_a_possible_stop_string_is_held_back_until_it_is_not_one(tokenizer):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    pieces = ["Hello", " ST", "a", " ST", "OP", " after"]
    steps = [[enc(p)] for p in pieces]
    deltas, _ = _run(tokenizer, RequestOutputKind.DELTA, steps, stop=["STOP"])
    texts = [d.outputs[0].text if d.outputs else "" for d in deltas]
    assert "".join(texts) == "Hello STa "
    assert not any("ST" in t and "STa" not in t for t in texts)  # " ST" waited for "a"
    # include_stop_str_in_output: nothing is held back, the stop string is sent
    deltas, _ = _run(tokenizer, RequestOutputKind.DELTA, steps, stop=["STOP"],
                     include_stop_str_in_output=True)
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == "Hello STa STOP"


def test_every_kind_offline_on_the_model():
    from pagedllm.engine.engine import LLMEngine

    engine = LLMEngine.from_kwargs(max_model_len=256, kv_cache_space=0.05)
    results = {}
    for kind in KINDS:
        params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, output_kind=kind,
                                ignore_eos=True,
                                logprobs=1)
        engine.add_request(f"req-{kind.name}", "Write a line about the sea.", params)
    outs: dict[str, list[RequestOutput]] = {f"req-{k.name}": [] for k in KINDS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    for kind in KINDS:
        got = outs[f"req-{kind.name}"]
        if kind is RequestOutputKind.DELTA:
            folded = got[0]
            for later in got[1:]:
                folded.add(later)
            got = [folded]
        results[kind] = [(c.index, c.text, c.token_ids) for c in got[-1].outputs]
    cumulative = outs["req-CUMULATIVE"]
    assert len(cumulative) >= 12 and len(outs["req-FINAL_ONLY"]) == 1
    assert results[RequestOutputKind.DELTA] == results[RequestOutputKind.CUMULATIVE]
    assert results[RequestOutputKind.FINAL_ONLY] == results[RequestOutputKind.CUMULATIVE]
    assert all(len(ids) == 12 for _, _, ids in results[RequestOutputKind.CUMULATIVE])
