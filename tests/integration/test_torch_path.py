"""The path every user without a C compiler gets: with `PAGEDLLM_DISABLE_C_KERNELS=1` (in a
subprocess, so that no kernel is loaded at all) greedy output on the default model equals the
kernel path's token for token, and start-up says that the slow torch path runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm import SamplingParams
from pagedllm.kernels import build as kernel_build
from tests.integration.prompts import PROMPTS

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

MAX_NEW = 32

_SCRIPT = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels import build
    gguf, prompts, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(gguf, kv_cache_space=0.5, max_model_len=2048)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
    loaded = sorted(name for name, lib in build._loaded.items() if lib is not None)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "loaded": loaded}))
""")


def test_torch_path_greedy_equals_kernel_path(smollm2_gguf, smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = smollm2_llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    kernel_tokens = [o.outputs[0].token_ids for o in outs]

    env = dict(os.environ, **{kernel_build.DISABLE_ENV: "1"})
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, smollm2_gguf, json.dumps(prompt_ids), str(MAX_NEW)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [], "a C kernel was loaded with PAGEDLLM_DISABLE_C_KERNELS=1"
    assert "torch" in proc.stderr and kernel_build.DISABLE_ENV in proc.stderr, proc.stderr[-4000:]
    mismatches = [(i, ours, ref) for i, (ours, ref) in enumerate(zip(result["tokens"], kernel_tokens)) if ours != ref]
    assert not mismatches, f"{len(mismatches)}/{len(prompt_ids)} prompts differ: {mismatches}"
