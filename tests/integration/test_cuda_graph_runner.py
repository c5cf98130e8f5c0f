"""The CUDA-graph decode runner's bookkeeping on the CPU: persistent buffers, padding to the
bucket, the scratch block, eager above the largest bucket and for prefills.

A captured graph replays its kernels over the buffers it was captured with; the stand-in capture
here re-runs the captured function at replay over the same buffers, so a wrong buffer, a stale
padded row or a mis-sliced output gives different logits than the eager runner. (The capture
itself, `torch.cuda.graph`, runs only on a GPU: benchmarks/gpu_check.sh.)
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.model.loader import load_model
from pagedllm.worker.cuda_graphs import CapturedGraph
from pagedllm.worker.model_runner import ModelRunner
from tests.integration.model_fixtures import (
    TINY_VOCAB,
    ToyBlocks,
    make_hf_model,
    save_checkpoint,
    step_plan,
    table_step,
    tiny_config,
)

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

NUM_BLOCKS, BLOCK = 64, 8


def replay_by_call(fn, pool) -> CapturedGraph:
    output = fn()
    return CapturedGraph(lambda: output.copy_(fn()), output, pool)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = tiny_config("llama")
    path = save_checkpoint(make_hf_model(config, seed=3), tmp_path_factory.mktemp("graph-llama"))
    return load_model(str(path), None, config, torch.float32, torch.device("cpu")), config


def test_graph_steps_match_eager_steps(tiny):
    model, config = tiny
    eager = ModelRunner(model, config, NUM_BLOCKS, BLOCK, torch.float32, "cpu", max_model_len=256)
    graphed = ModelRunner(model, config, NUM_BLOCKS, BLOCK, torch.float32, "cpu", max_model_len=256,
                          cuda_graph_sizes=[1, 2, 4])
    assert graphed.cache_engine.num_blocks == NUM_BLOCKS + 1  # the scratch block
    graphed.cuda_graphs._capture = replay_by_call
    graphed.capture_cuda_graphs()
    graphs = graphed.cuda_graphs
    assert sorted(graphs._graphs) == [1, 2, 4]

    rng = random.Random(0)
    blocks = ToyBlocks(NUM_BLOCKS, BLOCK, seed=1)
    seqs = {i: [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(3, 20))] for i in range(5)}
    starts = {i: 0 for i in seqs}

    def step(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        sched = []
        for i in ids:
            toks = seqs[i][starts[i]:]
            sched.append(table_step(i, toks, starts[i], blocks.ensure(i, len(seqs[i]))))
        out = step_plan(sched)
        a = eager.execute_model(out).sample_logits
        b = graphed.execute_model(out).sample_logits.clone()  # a graph's rows live until its next replay
        for s, row in zip(sched, a):
            starts[s.seq_id] = len(seqs[s.seq_id])
            seqs[s.seq_id].append(int(row.argmax()))
        return a, b

    # prefill of 5 (eager), decodes of 5 (above the largest bucket: eager), of 3 (bucket 4, one
    # padded row), 1, 2, then 3 again after longer contexts.
    plan = [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 2, 4], [0, 2, 4], [1], [1, 3], [0, 2, 4], [3]]
    for ids in plan:
        a, b = step(ids)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert graphs.steps_run == 6  # every decode step of at most 4 sequences
    assert graphs.padded_rows == 1 + 1 + 1  # 3 in a bucket of 4, three times


def test_profile_run_goes_through_the_step_builder(tiny):
    model, config = tiny
    probe = ModelRunner(model, config, 1, BLOCK, torch.float32, "cpu", max_model_len=300)
    # 300 tokens over 7 sequences (43 or 42 each), every table all block 0: one logits row each
    assert probe.profile_run(300, num_seqs=7) == 7
    assert probe.profile_run(5, num_seqs=64) == 5  # never more sequences than tokens
