"""Where a decode step's time goes: torch.profiler over steady-state decode steps.

    python -m benchmarks.profile_step --batch-size 20 --input-len 128 --context 256
    python -m benchmarks.profile_step --batch-size 256 --input-len 990 --context 1000 --no-forward
    python -m benchmarks.profile_step --batch-size 1 --steps 200 --no-forward --no-profiler

Admits `--batch-size` random-token prompts, decodes until the contexts reach `--context` tokens,
then profiles `--steps` decode steps (the C decode step where it applies, worker/cpu_decode_step.py,
timing its own parts; `PAGEDLLM_DECODE_STEP=0` profiles the eager step). Prints the step time
split into the model forward (with the LM head) and everything else (scheduling, input preparation, sampling, detokenization: the engine
overhead), and the top operators by self CPU time; with the profiler, the step split into the
weights' products (int_gemm / gguf_gemm / float kernels, the LM head's among them), attention,
sampling and the rest (Python and bookkeeping), next to the weight-streaming floor (the weights'
bytes at the read bandwidth measured in the same run).

`--no-forward` replaces the model's forward by fixed random logits (the KV cache is never
written): the engine's own per-step work at batch sizes and contexts that would take minutes to
prefill for real (256 sequences x 1,000 tokens in a few seconds). The overhead is then the same
work as in a real step, without the profiler's view of the forward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--context", type=int, default=256, help="context length when profiling starts")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true",
                   help="profile the opt-in torch.compile'd decode graph of this batch size")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--quant-compute", default="auto", help="quant_compute of the engine (auto, int8)")
    p.add_argument("--kv-cache-space", type=float, default=None,
                   help="GiB of KV cache (default: what batch x context needs, at least 2)")
    p.add_argument("--no-forward", action="store_true",
                   help="stub the model forward (random logits): engine overhead only")
    p.add_argument("--no-profiler", action="store_true",
                   help="time the steps without torch.profiler (its per-operator cost inflates "
                        "code made of many small ops); no operator table")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from pagedllm import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind
    from pagedllm.engine.engine import LLMEngine

    total = args.context + args.steps + 4
    # float32 K/V of SmolLM2-sized models: 30 layers x 3 heads x 64 x 2 x 4 bytes a token.
    kv_space = args.kv_cache_space or max(2.0, args.batch_size * (total + 16) * 46080 * 1.05 / 2**30)
    engine = LLMEngine.from_kwargs(
        model=args.model, kv_cache_space=kv_space, quant_compute=args.quant_compute,
        max_num_seqs=args.batch_size, enable_prefix_caching=False,
        max_num_batched_tokens=max(2048, args.batch_size * args.input_len),
        compile_batch_sizes=[args.batch_size] if args.compile else None,
    )
    runner = engine.model_runner
    compile_s = None
    if args.compile:
        t = time.perf_counter()
        runner.wait_for_compilation()
        compile_s = round(time.perf_counter() - t, 1)
    rng = random.Random(0)
    vocab = engine.hf_config.vocab_size
    if args.no_forward:
        fixed = torch.randn(args.batch_size, vocab, generator=torch.Generator().manual_seed(0))

        def stub_run_model(inp):  # the logits rows the sampler would get, and nothing else
            return fixed[: len(inp.logits_rows)].clone()

        runner.run_model = stub_run_model
    # FINAL_ONLY, as LLM.generate asks: no per-step outputs that nobody reads
    params = SamplingParams(temperature=0.0, max_tokens=total - args.input_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(args.batch_size):
        ids = [rng.randrange(100, vocab) for _ in range(args.input_len)]
        engine.add_request(f"prof-{i}", {"prompt_token_ids": ids}, params)
    for _ in range(args.context - args.input_len):
        engine.step()

    forward_s: list[float] = []
    orig = runner.run_model

    def timed_run_model(*a, **kw):
        t = time.perf_counter()
        with record_function("model_forward_and_logits"):
            out = orig(*a, **kw)
        forward_s.append(time.perf_counter() - t)
        return out

    runner.run_model = timed_run_model
    c_step = runner.cpu_decode_step  # the C decode step (worker/cpu_decode_step.py): it times its own parts
    c_steps_before = c_step.steps if c_step is not None else 0
    if c_step is not None and not args.no_profiler:
        c_step.seconds = torch.zeros(3, dtype=torch.float64)
    # Label the projections and the decode attention: their C kernels, called through ctypes,
    # are invisible to the profiler otherwise.
    import pagedllm.layers.backends.torch_paged as backend_mod
    import pagedllm.layers.linear as linear_mod
    import pagedllm.model.llama as llama_mod

    def labelled(name, fn):
        def wrapper(*a, **kw):
            with record_function(name):
                return fn(*a, **kw)
        return wrapper

    import pagedllm.quantization.kernels.gguf_kernel as gguf_mod
    import pagedllm.quantization.kernels.int_kernel as int_mod

    patches = [(linear_mod, "linear", "projections (linear)"), (llama_mod, "linear", "projections (linear)"),
               (int_mod, "_int_matmul", "projections (int_gemm)"), (gguf_mod, "_gguf_matmul", "projections (gguf_gemm)"),
               (backend_mod, "paged_decode_attention_eager", "decode attention"),
               (backend_mod, "prefill_attention_c", "prefill attention"),
               (runner.model, "compute_logits", "LM head"), (runner, "_sample", "sampling"),
               (c_step, "run", "C decode step")]
    patches = [(mod, attr, name) for mod, attr, name in patches if mod is not None and hasattr(mod, attr)]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patches]
    for mod, attr, name in patches:
        setattr(mod, attr, labelled(name, getattr(mod, attr)))
    step_s = []
    profiler = (contextlib.nullcontext() if args.no_profiler
                else profile(activities=[ProfilerActivity.CPU]))
    with profiler as prof:
        for _ in range(args.steps):
            t = time.perf_counter()
            with record_function("engine_step"):
                engine.step()
            step_s.append(time.perf_counter() - t)
    runner.run_model = orig
    for mod, attr, fn in saved:
        setattr(mod, attr, fn)
    names = {name for _, _, name in patches}
    labels = {} if prof is None else {
        e.key: e.cpu_time_total / 1e3 / args.steps for e in prof.key_averages() if e.key in names}
    c_steps = (c_step.steps - c_steps_before) if c_step is not None else 0
    if c_step is not None and c_step.seconds is not None and c_steps:
        # inside the C step (its own clock): the layers' products, attention, norms/rotary/activation
        inside = (c_step.seconds * 1e3 / args.steps).tolist()
        labels["projections (in the C step)"] = inside[0]
        labels["decode attention"] = labels.get("decode attention", 0.0) + inside[1]
        labels["fused small ops (in the C step)"] = inside[2]
        c_step.seconds = None
    step, fwd = statistics.median(step_s), statistics.median(forward_s)
    from benchmarks.gguf_types import bandwidth_gbs
    from pagedllm.model.loader import weight_memory

    weight_bytes = sum(weight_memory(runner.model).values())
    bandwidth = bandwidth_gbs()
    if prof is not None:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.top))
    result = {
        "batch_size": args.batch_size, "context": args.context, "compiled": args.compile,
        "no_forward": args.no_forward, "c_decode_steps": c_steps,
        "step_ms": round(step * 1e3, 2), "model_forward_ms": round(fwd * 1e3, 2),
        "overhead_ms": round((step - fwd) * 1e3, 2),
        "overhead_share": round((step - fwd) / step, 4),
        "threads": torch.get_num_threads(), "compile_s": compile_s,
        "per_step_ms": {k: round(v, 2) for k, v in labels.items()},
        # every weight read once a step (the embedding table too, where the LM head is tied to it)
        "weights_mb": round(weight_bytes / 1e6, 1), "read_gbs": round(bandwidth, 1),
        "weight_streaming_floor_ms": round(weight_bytes / bandwidth / 1e6, 2),
    }
    if labels:
        products = sum(v for k, v in labels.items() if k.startswith("projections"))
        attention = labels.get("decode attention", 0.0) + labels.get("prefill attention", 0.0)
        sampling = labels.get("sampling", 0.0)
        small = labels.get("fused small ops (in the C step)", 0.0)
        result["split_ms"] = {  # the LM head's product is inside "weights" and "LM head" both
            "weights (all products)": round(products, 2), "of which LM head": round(labels.get("LM head", 0.0), 2),
            "attention": round(attention, 2), "sampling": round(sampling, 2),
            "norms, rotary, activation (in C)": round(small, 2),
            "python / bookkeeping (the rest)": round(step * 1e3 - products - attention - sampling - small, 2)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
