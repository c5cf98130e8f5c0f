"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

One class serves the three architectures; the differences are configuration: q/k/v biases
(`attention_bias`, always on for Qwen2 without an o-projection bias), sliding-window layers
(Mistral, Qwen2 `layer_types`), tied or separate LM head, `head_dim`, rope scaling. Parameter names
follow transformers' (`model.layers.N.self_attn...`) except that q/k/v and gate/up are fused into
`qkv_proj` and `gate_up_proj`; `load_weights` maps the checkpoint's separate matrices into them.

Tokens of all sequences of a step are flattened: `forward(input_ids [T], positions [T], kv_caches,
attn_metadata) -> hidden [T, hidden]`; `compute_logits(hidden [R, hidden]) -> [R, vocab]` float32.

Tensor parallelism (`tp`, a group of N ranks; docs/tensor_parallel.md): every rank builds the
same model in local sizes: its query heads and KV heads (KV heads replicated when there are
fewer than N), its part of the intermediate size and of the vocabulary. qkv and gate/up are
column-parallel, o and down row-parallel (one all-reduce each), the embedding vocab-parallel
(one all-reduce), the LM head vocab-parallel (its logits gathered on rank 0, the only rank that
samples; None elsewhere). `checkpoint_slices(name)` tells the loaders which part of each
checkpoint tensor this rank reads. With N = 1 nothing is split and no collective runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.core.kv_cache_groups import layer_sliding_window
from pagedllm.distributed.parallel_state import TensorParallelGroup, gather_logits
from pagedllm.distributed.sharding import column_shard, head_shard, row_shard, shard_range, vocab_shard
from pagedllm.layers import kernel_choice
from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.attention import Attention, AttentionMetadata
from pagedllm.layers.linear import (
    Linear,
    MergedLinear,
    RowParallelLinear,
    VocabEmbedding,
    current_prepared,
    linear_prepared,
    prepare_weight,
)
from pagedllm.layers.norm import RMSNorm
from pagedllm.quantization.formats.base import LinearMethod, QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding, head_dim_of, rotate_qkv

KVCache = torch.Tensor  # one layer's cache: [2 (keys, values), num_blocks, block_size, Hk, D]
SINGLE = TensorParallelGroup(0, 1, "none")  # no tensor parallelism

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


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = d = head_dim_of(config)
        qkv_shard = o_shard = None
        if tp.world_size > 1:  # this rank's heads (KV heads replicated when fewer than ranks)
            (q_first, self.num_heads), (kv_first, self.num_kv_heads) = head_shard(
                total_heads, total_kv_heads, tp.rank, tp.world_size)
            qkv_shard = column_shard([total_heads * d, total_kv_heads * d, total_kv_heads * d],
                                     [(q_first * d, self.num_heads * d), (kv_first * d, self.num_kv_heads * d),
                                      (kv_first * d, self.num_kv_heads * d)], hidden)
            o_shard = row_shard(total_heads * d, hidden, tp.rank, tp.world_size, "the attention output")
        else:
            self.num_heads, self.num_kv_heads = total_heads, total_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias, o_bias = self.projection_biases(config)
        self.qkv_proj = MergedLinear(
            hidden,
            [self.q_size, self.kv_size, self.kv_size],
            bias=qkv_bias,
            dtype=dtype,
            device=device,
            quant_method=quant_method_for(quant_config, f"{prefix}.qkv_proj"),
            tp_shard=qkv_shard,
        )
        o_cls = RowParallelLinear if o_shard is not None else Linear
        self.o_proj = o_cls(self.q_size, hidden, bias=o_bias, dtype=dtype, device=device,
                            quant_method=quant_method_for(quant_config, f"{prefix}.o_proj"), tp_shard=o_shard)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=layer_sliding_window(config, layer_idx),
            device=device,
        )

    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o bias): Qwen2 biases q/k/v only, the others follow `attention_bias`
        (a subclass hook: Qwen2-MoE's `qkv_bias`)."""
        is_qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        return attention_bias or is_qwen2, attention_bias and not is_qwen2

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = rotate_qkv(self.qkv_proj(hidden), cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, inter = config.hidden_size, config.intermediate_size
        gate_up_shard = down_shard = None
        local = inter
        if tp.world_size > 1:
            start, local = shard_range(inter, tp.rank, tp.world_size, "the intermediate size")
            gate_up_shard = column_shard([inter, inter], [(start, local), (start, local)], hidden)
            down_shard = row_shard(inter, hidden, tp.rank, tp.world_size, "the intermediate size")
        self.gate_up_proj = MergedLinear(hidden, [local, local], bias=bias, dtype=dtype, device=device,
                                         quant_method=quant_method_for(quant_config, f"{prefix}.gate_up_proj"),
                                         tp_shard=gate_up_shard)
        down_cls = RowParallelLinear if down_shard is not None else Linear
        self.down_proj = down_cls(local, hidden, bias=bias, dtype=dtype, device=device,
                                  quant_method=quant_method_for(quant_config, f"{prefix}.down_proj"),
                                  tp_shard=down_shard)
        self.act_fn = get_act_and_mul(self.activation(config))

    @staticmethod
    def activation(config: Any) -> str:
        """The gated activation's name (a subclass hook: Gemma's `hidden_activation`)."""
        return config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer. Other architectures subclass it and change `attention_cls`,
    `norm_cls` or `make_mlp` (e.g. Qwen3's q/k-normed attention, a mixture-of-experts block,
    Gemma's `(1 + weight)` norms)."""

    attention_cls: type[nn.Module] = LlamaAttention
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        prefix = f"model.layers.{layer_idx}"
        self.input_layernorm = self.norm_cls(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = self.attention_cls(config, layer_idx, dtype, device, quant_config, f"{prefix}.self_attn", tp)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = self.make_mlp(config, layer_idx, dtype, device, quant_config, f"{prefix}.mlp", tp)

    def make_mlp(self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None, prefix: str, tp: TensorParallelGroup) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (a dense gated MLP here)."""
        return LlamaMLP(config, dtype, device, quant_config, prefix, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(output, residual)`: the layer's output is `output + residual`; the sum is left to the
        next norm, which fuses it (the first layer gets `residual=None`)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm  # the final norm's class

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        parallel = tp.world_size > 1
        vocab_range = vocab_shard(config.vocab_size, tp.rank, tp.world_size) if parallel else None
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device,
                                           vocab_range=vocab_range, parallel=parallel)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, dtype, device, quant_config, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding.from_config(config, device=device)


class LlamaForCausalLM(nn.Module):
    """Causal LM over flattened tokens and a paged KV cache (Llama, Mistral, Qwen2; other
    architectures subclass it and set `model_cls`)."""

    model_cls: type[nn.Module] = LlamaModel

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant_config: QuantizationConfig | None = None,
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.quant_config = quant_config  # the decoder's projections; embeddings and LM head stay float
        self.model = self.model_cls(config, dtype, device, quant_config, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            embed = self.model.embed_tokens
            shard = None
            if tp.world_size > 1:  # vocab-parallel: the same rows as the embedding
                shard = column_shard([config.vocab_size], [(embed.vocab_start, embed.vocab_rows)], config.hidden_size)
            # A GGUF file's head (often Q6_K / Q8_0) stays in its blocks like every projection.
            head_method = quant_config.get_linear_method("lm_head", ["lm_head"]) \
                if quant_config is not None and quant_config.name == "gguf" else None
            self.lm_head = Linear(config.hidden_size, embed.vocab_rows, bias=False, dtype=dtype, device=device,
                                  tp_shard=shard, quant_method=head_method)
        self.head_prepared = None  # the C kernels' form of a tied head (an untied one is a Linear)

    # Shapes the model runner / cache engine need.
    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    @property
    def vocab_size(self) -> int:
        return self.model.embed_tokens.num_embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, attn_metadata)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn_metadata)
        return self.model.norm(hidden, residual)[0]

    @classmethod
    def check_tensor_parallel(cls, config: Any, world: int) -> None:
        """ValueError naming the numbers when this model cannot be split over `world` ranks
        (checked before any worker starts)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % world:
            divisors = [n for n in range(1, heads + 1) if heads % n == 0]
            raise ValueError(f"tensor_parallel_size={world} does not divide the model's {heads} attention heads "
                             f"({kv_heads} KV heads); it must be one of {divisors}")
        head_shard(heads, kv_heads, 0, world)
        for what, size in cls.tp_split_sizes(config).items():
            shard_range(size, 0, world, f"tensor_parallel_size={world}: {what}")
        if config.vocab_size < world:
            raise ValueError(f"tensor_parallel_size={world} is larger than the vocabulary ({config.vocab_size})")

    @classmethod
    def tp_split_sizes(cls, config: Any) -> dict[str, int]:
        """The sizes every rank takes an equal part of, besides heads and vocabulary, by name (a
        subclass hook: a mixture of experts splits each expert's intermediate size)."""
        return {"the intermediate size": config.intermediate_size}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits `[rows, vocab]`; with tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self._local_logits(hidden)
        if self.tp.world_size > 1:
            return gather_logits(logits, self.vocab_size)
        return logits

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens
        if self.lm_head is None and embed.packed:  # tied to a packed GGUF table
            compute = self.quant_config.compute if self.quant_config is not None else "exact"
            return embed.packed_logits(hidden, compute)
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        head = embed.weight
        if not torch.compiler.is_compiling() and head.device.type == "cpu":
            self.head_prepared = current_prepared(head, self.head_prepared)  # made once, kept
        return linear_prepared(hidden, head, None, self.head_prepared).float()

    def _head_weight(self) -> torch.Tensor | None:
        """The LM head's float weight (None: a tied head on a packed embedding table)."""
        return self.model.embed_tokens.weight if self.lm_head is None else getattr(self.lm_head, "weight", None)

    def projection_weights(self) -> list[torch.Tensor]:
        """Every float weight that goes through `linear` (the projections and the LM head)."""
        weights = [m.weight for m in self.modules() if isinstance(m, Linear) and getattr(m, "weight", None) is not None]
        head = self._head_weight()
        return weights + ([head] if head is not None else [])

    def process_weights_after_loading(self) -> None:
        """Once, after loading: each layer's compute form (quantized methods, C kernel forms)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        embed = self.model.embed_tokens
        if self.lm_head is None and embed.weight is not None:
            self.head_prepared = prepare_weight(embed.weight)
        elif self.lm_head is None and embed.packed:  # tied to a packed GGUF table
            embed.choose_logit_paths(self.quant_config.compute if self.quant_config is not None else "exact")
        kernel_choice.save()  # this process's measurements, for the next start
        kernel_choice.log_summary()

    # ---- weights -------------------------------------------------------------------------
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
