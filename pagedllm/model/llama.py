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

Loading (checkpoint names, fp8 KV scales, quantized tensors, each rank's cuts) is in
model/llama_checkpoint.py.
"""

from __future__ import annotations

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
from pagedllm.model.llama_checkpoint import LlamaCheckpointLoading, quant_method_for
from pagedllm.quantization.formats.base import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding, head_dim_of, rotate_qkv

KVCache = torch.Tensor  # one layer's cache: [2 (keys, values), num_blocks, block_size, Hk, D]
SINGLE = TensorParallelGroup(0, 1, "none")  # no tensor parallelism


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
        is_qwen2 = config.model_type in ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
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


class LlamaForCausalLM(LlamaCheckpointLoading, nn.Module):
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
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states; `inputs_embeds` (a step with image rows, worker/mm_embeddings.py)
        replaces the embedding of `input_ids`."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.model.rotary_emb(positions, attn_metadata)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn_metadata)
        return self.model.norm(hidden, residual)[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of token ids as the first layer takes it (Gemma scales it)."""
        return self.model.embed_tokens(input_ids)

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
