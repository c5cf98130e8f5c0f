"""How a Llama-family checkpoint's tensors reach the model: transformers' names mapped onto the
fused q/k/v and gate/up layers, the fp8 KV cache scales onto the Attention layers, each
quantized layer's tensors handed to its method, and (with tensor parallelism) which cut of each
tensor this rank reads. Apart from model/llama.py because it is about the checkpoint's naming,
not the forward pass; every architecture that subclasses `LlamaForCausalLM` loads through it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.sharding import head_shard
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear, MergedLinear, VocabEmbedding
from pagedllm.quantization.formats.base import LinearMethod, QuantizationConfig

# checkpoint projection name -> (our fused module name, shard index)
_STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_SHARD_NAMES = {fused: [n for n, (f, _) in _STACKED_PARAMS.items() if f == fused] for fused, _ in _STACKED_PARAMS.values()}
# fp8 KV cache scales (docs/kv_cache.md): checkpoint suffix after `model.layers.N.self_attn` ->
# the Attention buffers it sets, as vLLM maps them: compressed-tensors / llm-compressor
# (`k_scale`), their `k_proj.output_scale` form, ModelOpt (`k_proj.k_scale`), the deprecated
# single `kv_scale` (both), and our own buffer names.
_KV_SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k_scale",), "v_scale": ("v_scale",),
    "k_proj.output_scale": ("k_scale",), "v_proj.output_scale": ("v_scale",),
    "k_proj.k_scale": ("k_scale",), "v_proj.v_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),
    "attn.k_scale": ("k_scale",), "attn.v_scale": ("v_scale",),
}
# Scales of fp8 *attention arithmetic* (the query, the softmax probabilities): vLLM uses them
# only for fp8 attention kernels, which pagedllm has not; accepted and not used.
_UNUSED_ATTN_SCALES = ("q_scale", "q_proj.output_scale", "prob_scale", "attn.q_scale", "attn.prob_scale")


def _kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """`model.layers.3.self_attn.k_proj.output_scale` -> (`model.layers.3.self_attn.attn`,
    ("k_scale",)); `()` for an accepted scale that is not used; None for any other name."""
    head, sep, tail = name.partition(".self_attn.")
    if not sep:
        return None
    if tail in _KV_SCALE_NAMES:
        return f"{head}.self_attn.attn", _KV_SCALE_NAMES[tail]
    if tail in _UNUSED_ATTN_SCALES:
        return f"{head}.self_attn.attn", ()
    return None


def quant_method_for(quant_config: QuantizationConfig | None, prefix: str) -> LinearMethod | None:
    """The linear method of our module `prefix` (None: a float layer). A fused module asks
    about the checkpoint's modules it stands for (q_proj/k_proj/v_proj, gate_proj/up_proj)."""
    if quant_config is None:
        return None
    parent, _, leaf = prefix.rpartition(".")
    shards = [f"{parent}.{n}" for n in _SHARD_NAMES.get(leaf, [leaf])]
    return quant_config.get_linear_method(prefix, shards)


class LlamaCheckpointLoading:
    """`load_weights` and `checkpoint_slices` of `LlamaForCausalLM` (an nn.Module, which sets
    these attributes in its __init__)."""

    config: Any
    tp: TensorParallelGroup
    model: nn.Module
    lm_head: Linear | None
    tie_word_embeddings: bool

    def checkpoint_slices(self, name: str, shape: tuple[int, ...] | None = None) -> list[tuple[int, int, int]]:
        """The `(dim, start, length)` cuts of checkpoint tensor `name` (stored with `shape`)
        that this rank holds; empty: all of it (no tensor parallelism, norms, unknown names,
        which `load_weights` then rejects)."""
        if self.tp.world_size == 1:
            return []
        modules = self.__dict__.get("_module_index") or self.__dict__.setdefault("_module_index",
                                                                                 dict(self.named_modules()))
        kv_scale = _kv_scale_target(name)
        if kv_scale is not None:  # a per-head scale: this rank's KV heads, as k_proj's rows
            if shape is None or math.prod(shape) <= 1:
                return []  # one scale for all heads: every rank reads it whole
            total = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
            _, (kv_first, kv_local) = head_shard(self.config.num_attention_heads, total, self.tp.rank,
                                                 self.tp.world_size)
            return [(0, kv_first, kv_local)] if shape[0] == total else []  # else load_weights names the shape
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _STACKED_PARAMS:
            fused, shard = _STACKED_PARAMS[parts[-2]]
            module = modules.get(".".join(parts[:-2] + [fused]))
            return module.checkpoint_slices(parts[-1], shard, shape) if isinstance(module, Linear) else []
        if name == "lm_head.weight" and self.lm_head is None:
            return self.model.embed_tokens.checkpoint_slices()  # skipped (tied); read only a part
        module = modules.get(".".join(parts[:-1]))
        if isinstance(module, Linear):
            return module.checkpoint_slices(parts[-1], None, shape)
        if isinstance(module, VocabEmbedding):
            return module.checkpoint_slices()
        return []

    def _expected_weights(self) -> set[tuple[str, int | None]]:
        expected: set[tuple[str, int | None]] = set()
        for mod_name, module in self.named_modules():
            if isinstance(module, Linear):
                shards = range(len(module.output_sizes)) if isinstance(module, MergedLinear) else [None]
                expected.update((f"{mod_name}.{n}", s) for n in module.required_weights() for s in shards)
                continue
            for p_name, param in module.named_parameters(recurse=False):
                if param is None:
                    continue
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if isinstance(module, MergedLinear):
                    expected.update((full, s) for s in range(len(module.output_sizes)))
                else:
                    expected.add((full, None))
        return expected

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load transformers-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...).

        q/k/v and gate/up go into their fused layers. fp8 KV cache scales (`self_attn.k_scale`,
        `k_proj.output_scale`, ...: `_KV_SCALE_NAMES`) go into the Attention layer's `k_scale` /
        `v_scale` whatever `kv_cache_dtype` is; only an fp8 cache reads them (vLLM ignores them
        likewise). Raises ValueError for an unknown name, a shape mismatch, or a parameter that
        the checkpoint does not provide.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding table is the head
            kv_scale = _kv_scale_target(name)
            if kv_scale is not None:  # before the stacked names: `k_proj.output_scale` is no k_proj weight
                attn = modules.get(kv_scale[0])
                if not isinstance(attn, Attention):
                    raise ValueError(f"Unexpected weight {name!r} in checkpoint")
                for which in kv_scale[1]:
                    try:
                        attn.load_kv_scale(which, tensor)
                    except ValueError as e:
                        raise ValueError(f"Loading {name}: {e}") from None
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _STACKED_PARAMS:
                fused, shard = _STACKED_PARAMS[parts[-2]]
                mod_name = ".".join(parts[:-2] + [fused])
                try:
                    module = self.get_submodule(mod_name)
                except AttributeError:
                    raise ValueError(f"Unexpected weight {name!r} in checkpoint") from None
                module.load_shard(shard, parts[-1], tensor)
                loaded.add((f"{mod_name}.{parts[-1]}", shard))
                continue
            module = modules.get(".".join(parts[:-1]))
            if isinstance(module, Linear) and module.quant_method is not None and parts[-1] != "bias":
                module.load_weight(parts[-1], tensor)  # the method checks names, shapes, dtypes
                loaded.add((name, None))
                continue
            gguf_packed = not isinstance(tensor, torch.Tensor)  # a GGUF file's blocks (GGUFTensor)
            if isinstance(module, VocabEmbedding) and gguf_packed:
                module.load_blocks(tensor)  # kept in the file's blocks
                loaded.add((name, None))
                continue
            if gguf_packed:  # GGUF blocks for a float parameter
                tensor = tensor.dequantize()
            param = params.get(name)
            if param is None:
                raise ValueError(f"Unexpected weight {name!r} in checkpoint")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"Shape mismatch loading {name}: checkpoint has {tuple(tensor.shape)}, "
                    f"model expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add((name, None))
        missing = self._expected_weights() - loaded
        if missing:
            names = sorted(self.checkpoint_name(n, s) for n, s in missing)
            raise ValueError(f"Checkpoint is missing {len(missing)} weight(s): {names[:10]}")

    def checkpoint_name(self, name: str, shard: int | None) -> str:
        """A missing parameter as the error names it: ours, and the checkpoint's name of a fused
        shard (a subclass hook for checkpoints that spell their tensors otherwise)."""
        return name if shard is None else f"{name}[shard {shard}] ({_checkpoint_name(name, shard)})"


def _checkpoint_name(fused_name: str, shard: int) -> str:
    """`model.layers.0.self_attn.qkv_proj.scales`, shard 1 -> `model.layers.0.self_attn.k_proj.scales`."""
    parts = fused_name.split(".")
    parts[-2] = _SHARD_NAMES[parts[-2]][shard]
    return ".".join(parts)
