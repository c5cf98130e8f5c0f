"""Multi-LoRA serving (issue 27): adapters applied per request on one shared base model, a
batch mixing tokens of several adapters and of the base model.

- `request.py`: `LoRARequest`, what a request names its adapter by (torch-free: it crosses the
  front end / core process boundary inside the core's messages).
- `model_spec.py`: what a model offers to LoRA (`LoRAModelSpec`: its projections' full sizes,
  fused layers, tensor-parallel split); `adapter.py`: `LoRAAdapter` and `shard_adapter` (one
  rank's part of an adapter).
- `peft_config.py` / `peft_adapter.py`: a PEFT adapter folder checked against that spec and
  loaded as a `LoRAAdapter` (float32 A / B per layer and projection, scaling folded into B).
- `adapter_cache.py`: `LoRASlots`, the worker's device slots (what one step can use) over an LRU
  host cache of loaded adapters (vLLM's `max_loras` / `max_cpu_loras`).
- `ops.py`: the batched shrink / expand (one kernel call per op for the whole batch, indexed by
  a per-token adapter slot: kernels/lora.c on CPU, triton_ops.py on CUDA).
- `layers.py`: the slots on the model's projections and the step's token indices;
  `worker_manager.py`: a rank's adapters into those slots per step; `core_registry.py`: the
  engine core's pins (adapters of live requests stay loaded).

This package file imports nothing, so that importing `pagedllm.lora.request` stays light.
docs/lora.md describes it all.
"""
