"""The draft-model method's costs (issue 26), single stream, SmolLM2 (the default model):

- SmolLM2 as its own draft (nearly every draft accepted): what a step costs, split into the
  draft's forwards and the target's verification, per emitted token, against a plain decode;
- a random 2-layer draft of SmolLM2's vocabulary (nearly nothing accepted): the slowdown with
  the back-off of failing proposals (spec_decode/backoff.py) and without it.

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.spec_decode_draft --json-out benchmarks/results/spec_decode_draft.json

One engine per configuration, one warm-up request, then `--repeats` timed runs of the same
requests one after the other (greedy, `--max-tokens` each); the median run is reported. The
outputs of every configuration are compared with the plain engine's (greedy: equal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List five fruits and their colours.",
    "What is the capital of Japan, and what is it famous for?",
    "Describe how a bicycle works.",
    "Give three tips for learning a new language.",
]


def _random_draft(folder: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          tie_word_embeddings=False)
        LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return str(folder)


class _StepTimer:
    """Wall time of the draft's proposals and of whole runner steps (monkeypatched in)."""

    def __init__(self, runner) -> None:
        self.draft_s = 0.0
        self.step_s = 0.0
        self.steps = 0
        execute = runner.execute_model
        drafter = runner.drafter

        def timed_execute(out):
            t = time.perf_counter()
            try:
                return execute(out)
            finally:
                self.step_s += time.perf_counter() - t
                self.steps += 1

        runner.execute_model = timed_execute
        if drafter is not None:
            propose = drafter.propose

            def timed_propose(scheduled):
                t = time.perf_counter()
                try:
                    return propose(scheduled)
                finally:
                    self.draft_s += time.perf_counter() - t

            drafter.propose = timed_propose

    def reset(self) -> None:
        self.draft_s = self.step_s = 0.0
        self.steps = 0


def run(name: str, spec: dict | None, args, no_backoff: bool = False) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(max_model_len=1024, kv_cache_space=0.5, speculative_config=spec)
    core = llm.llm_engine.core
    if no_backoff:
        core.speculation.backoff.allows = lambda seq_id, step: True
    timer = _StepTimer(core.model_runner)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in PROMPTS[: args.num_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    runs, outputs = [], None
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        timer.reset()
        before = (core.speculation.stats.num_draft_tokens, core.speculation.stats.num_accepted_tokens) if core.speculation else (0, 0)
        t = time.perf_counter()
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one at a time
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        drafted, accepted = ((core.speculation.stats.num_draft_tokens - before[0], core.speculation.stats.num_accepted_tokens - before[1])
                             if core.speculation else (0, 0))
        runs.append(dict(tok_s=tokens / wall, tokens=tokens, steps=timer.steps, draft_s=timer.draft_s,
                         step_s=timer.step_s, drafted=drafted, accepted=accepted))
        outputs = [o.outputs[0].token_ids for o in outs]
    med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    res = dict(name=name, tok_s=med["tok_s"], runs=[round(r["tok_s"], 2) for r in runs],
               tokens_per_step=med["tokens"] / max(1, med["steps"]),
               ms_per_step=1e3 * med["step_s"] / max(1, med["steps"]),
               draft_ms_per_step=1e3 * med["draft_s"] / max(1, med["steps"]),
               verify_ms_per_token=1e3 * (med["step_s"] - med["draft_s"]) / max(1, med["tokens"]),
               acceptance=med["accepted"] / med["drafted"] if med["drafted"] else None)
    del llm
    return res, outputs


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    from pagedllm.model_source import default_model_path

    draft = _random_draft(Path(tempfile.gettempdir()) / "pagedllm-bench-random-draft")
    configs = [("plain", None, False),
               ("SmolLM2 as its own draft", {"model": str(default_model_path()), "num_speculative_tokens": args.k}, False),
               ("random draft, back-off", {"model": draft, "num_speculative_tokens": args.k}, False),
               ("random draft, no back-off", {"model": draft, "num_speculative_tokens": args.k}, True)]
    rows, want = [], None
    for name, spec, no_backoff in configs:
        res, outs = run(name, spec, args, no_backoff)
        want = want if want is not None else outs
        res["equal_to_plain"] = outs == want
        rows.append(res)
        print(json.dumps(res), flush=True)
    base = rows[0]
    print(f"\n| configuration | output tok/s (median of {args.repeats}) | vs plain | tokens / step | ms / step "
          "| draft ms / step | target ms / emitted token | acceptance | greedy equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        print(f"| {r['name']} | {r['tok_s']:.2f} | {r['tok_s'] / base['tok_s']:.3f}x | {r['tokens_per_step']:.2f} | "
              f"{r['ms_per_step']:.2f} | {r['draft_ms_per_step']:.2f} | {r['verify_ms_per_token']:.2f} | {acc} | "
              f"{r['equal_to_plain']} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
