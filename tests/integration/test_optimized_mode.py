"""The engine under `python -O`, which strips every `assert`: preemption by swap and recompute
must still give the same output, so no bookkeeping may hide inside an assert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_swap import reference  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

SCRIPT = """
import json, sys
assert False, "this line must not run under -O"
from pagedllm import LLM
from tests.integration.test_swap import run
llm = LLM(sys.argv[1], num_kv_blocks=10, swap_space=0.05, enable_prefix_caching=False)
out = run(llm)
stats = llm.kv_cache_stats()
kv = llm.llm_engine.kv_cache_manager
print(json.dumps({"optimize": sys.flags.optimize, "out": out,
                  "preemptions": stats.num_preemptions, "swapped_out": stats.num_swapped_out,
                  "free": kv.num_free_blocks, "blocks": llm.llm_engine.num_blocks}))
"""


def test_swap_and_recompute_under_python_O(smollm2_gguf, reference):  # noqa: F811
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-O", "-c", SCRIPT, smollm2_gguf], cwd=root, capture_output=True,
        text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["optimize"] == 1
    assert got["preemptions"] > 0 and got["swapped_out"] > 0  # both paths really ran
    assert got["free"] == got["blocks"]
    assert got["out"] == reference
