"""Tensor parallelism's building blocks (issue 12, first slice; not wired into the engine yet:
`tensor_parallel_size` other than 1 is still refused by EngineConfig).

- `parallel_state`: the tensor-parallel process group over torch.distributed (gloo on CPU, NCCL
  on GPU) and its collectives;
- `sharding`: which rows / columns / heads each rank owns (vLLM's column- and row-parallel
  split, KV heads replicated when there are fewer than ranks).
"""
