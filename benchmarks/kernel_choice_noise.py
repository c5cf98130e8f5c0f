"""The default kernel choice against noise: a first start made while other processes load the
CPUs must not leave the default slower than `PAGEDLLM_KERNEL_CHOICE=kernel` (issue 43).

Each row runs in fresh processes sharing one fresh kernel cache folder:
1. a first start in the default mode (`measure`), with `--busy` busy-loop processes running
   beside it (0: a quiet first start), which may write the per-machine choice cache;
2. then, on the quiet machine, one stream (32-token prompt, 128 tokens, greedy, medians of 3) in
   the default mode (reading whatever step 1 cached) and in `kernel` mode.

    python -m benchmarks.kernel_choice_noise [--busy 0,1,2] [--float]

`--float` loads the default model's weights widened to float32 (`PAGEDLLM_GGUF_BLOCKS=0`): the
float layers are the ones the choice measures (quantized weights keep the packed kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''
import json, logging, sys, time
logging.basicConfig(level=logging.WARNING)
from pagedllm import LLM, SamplingParams
from pagedllm.layers import kernel_choice
llm = LLM(kv_cache_space=0.25, max_model_len=1024)
result = {"spent_s": kernel_choice.spent_seconds(),
          "torch_buckets": sum(p == "torch" for v in kernel_choice.used().values() for p in v)}
if sys.argv[1] == "run":
    ids = [{"prompt_token_ids": list(range(100, 132))}]
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
        rates.append(128 / (time.perf_counter() - t0))
    result["tok_s"] = sorted(rates)[1]
print(json.dumps(result))
'''

BUSY = "import time\nt = time.time() + 600\nwhile time.time() < t: pass"


def child(what: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, what], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--busy", default="0,2", help="busy processes beside each first start")
    p.add_argument("--float", action="store_true", help="weights widened to float32 (measured layers)")
    args = p.parse_args()
    print("| busy processes at first start | torch buckets kept (first start) | default tok/s (quiet) "
          "| torch buckets (quiet run) | kernel mode tok/s | default / kernel |")
    print("|---|---|---|---|---|---|")
    for busy in (int(b) for b in args.busy.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, PAGEDLLM_CACHE_DIR=cache, PAGEDLLM_KERNEL_CHOICE="measure")
            if args.float:
                env["PAGEDLLM_GGUF_BLOCKS"] = "0"
            model_cache = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
            for name in os.listdir(model_cache) if os.path.isdir(model_cache) else []:
                if name.endswith(".gguf"):  # the default model, where the cache folder expects it
                    os.symlink(os.path.join(model_cache, name), os.path.join(cache, name))
            loads = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
            try:
                first = child("start", env)
            finally:
                for proc in loads:
                    proc.kill()
                    proc.wait()
            default = child("run", env)
            kernel = child("run", dict(env, PAGEDLLM_KERNEL_CHOICE="kernel"))
            print(f"| {busy} | {first['torch_buckets']} | {default['tok_s']:.1f} | {default['torch_buckets']} "
                  f"| {kernel['tok_s']:.1f} | {default['tok_s'] / kernel['tok_s']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
