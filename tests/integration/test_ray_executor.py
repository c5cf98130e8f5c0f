"""Tensor parallelism with Ray actors (`distributed_executor_backend="ray"`): a local Ray cluster
of two nodes on this machine (one CPU each, `ray.cluster_utils.Cluster`); TP=2 placed across
them (SPREAD: one bundle per node) gives the same greedy output as one rank."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from tests.integration.test_tensor_parallel import PROMPTS, _running, _save_tiny, _tokenizer, greedy, tp_llm

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ray_two_ranks_across_two_nodes_equal_one(two_node_cluster, smollm2_gguf, tmp_path, monkeypatch):
    path = _save_tiny(tmp_path / "llama", "llama", _tokenizer(smollm2_gguf))
    expected = greedy(LLM(path, kv_cache_space=0.05, block_size=8))
    assert len(ray.nodes()) == 2
    # STRICT_PACK (the default) cannot put two 1-CPU bundles on a 1-CPU node: the error says so
    with pytest.raises(ValueError, match=r"cannot place 2 bundles of \{'CPU': 1.0\} \(STRICT_PACK\)"):
        import pagedllm.executor.ray_executor as rx

        monkeypatch.setattr(rx, "PLACEMENT_WAIT_S", 5.0)
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_space=0.05)
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_STRATEGY", "SPREAD")
    with tp_llm(path, 2, distributed_executor_backend="ray", kv_cache_space=0.05, block_size=8) as llm:
        assert greedy(llm) == expected
        executor = llm.llm_engine.core.executor
        nodes = ray.util.placement_group_table(executor._pg)["bundles_to_node_id"]
        assert len(set(nodes.values())) == 2  # SPREAD: rank 1's bundle on the other node than rank 0's
        # (rank 0's bundle asks for its node by IP; both nodes here have this machine's IP)
        (pid,) = executor.worker_pids
        assert _running(pid)  # the actor's process (both nodes are this machine)
        assert len(greedy(llm, PROMPTS[:1])[0][0]) == 20
