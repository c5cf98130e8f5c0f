"""The C decode step: a decode-only step of a dense decoder on CPU as one call into
kernels/decode_step.c — the CPU analogue of a captured CUDA graph.

The families it describes (`_layer_reason` says which layers; `_make_plan` fills one `_Layer`
record each): Llama / Mistral / Qwen2 / Phi-3 (pre-norms, SiLU),
Qwen3 (per-head q/k norms), Gemma 2 / Gemma 3 (four norms a layer with `(1 + weight)`, GELU-tanh,
attention soft caps, a rotary table per layer type, a scaled embedding), with sliding layers in
a hybrid KV cache's own groups (each group's block tables). A family differs from the others by
the fields of one layer description, not by a separate step.

Why: the eager step calls about 12 Python-level operations a layer (views, argument checks and a
ctypes call each); on the default model's 30 layers that was a third of a one-row step. Here the
model is described once (weights' kernel forms, norms, KV cache pointers) and each decode step
is: the embedding lookup and the rotary table in torch, then one C call for every layer and the
final norm. The C code calls the same kernels as the eager path, in the same order, with the same
arguments, so the hidden states are the eager path's to the bit (tests/integration/
test_cpu_decode_step.py compares them).

It applies to a step only when every part can run in C: a decode-only step (one token a
sequence), no LoRA, float32 on CPU, each projection's path at this batch
bucket one of the C kernels (layers/decode_step_parts.py: not where kernel_choice kept torch's
op), KV caches of a kind the attention kernel reads (float32, bfloat16, int8). Anything else —
prefills, mixed batches, other architectures (mixtures of experts, partial rotary),
`enforce_eager=True`, `PAGEDLLM_DECODE_STEP=0` —
runs the eager model, which stays the reference and the debugging path. When the kernel refuses
its input (a bad slot, a block table too short) the step returns None and the eager step
re-runs, which names the problem.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedllm import envs
from pagedllm.kernels import decode_step_kernel, gguf_gemm_kernel, int_gemm_kernel, packed_gemm_kernel
from pagedllm.layers import kernel_choice
from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.backends.decode_op import decode_softcap_kernel
from pagedllm.layers.decode_step_parts import (
    OP_GGUF_EXACT,
    OP_GGUF_INT8,
    OP_INT_EXACT,
    OP_INT_INT8,
    OP_PACKED_F32,
    StepPart,
)
from pagedllm.layers.kv_cache_dtype import KERNEL_KIND, split_kv_cache
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.mrope import MRotaryEmbedding
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from pagedllm.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from pagedllm.model.qwen3 import Qwen3Attention

logger = logging.getLogger(__name__)

ENV = "PAGEDLLM_DECODE_STEP"  # 0: decode steps run the eager model (A/B measurements, debugging)
MAX_PARTS = 4  # decode_step.c's MAX_PARTS


class _Part(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int32), ("bits", ctypes.c_int32), ("kind", ctypes.c_int32),
                ("type", ctypes.c_int32), ("rows", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("weight", ctypes.c_void_p)]


class _Linear(ctypes.Structure):
    _fields_ = [("n_parts", ctypes.c_int32), ("pad", ctypes.c_int32), ("out_features", ctypes.c_int64),
                ("in_features", ctypes.c_int64), ("bias", ctypes.c_void_p), ("parts", _Part * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("pre_ff_norm", ctypes.c_void_p),
                ("post_ff_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("key_cache", ctypes.c_void_p), ("value_cache", ctypes.c_void_p), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("window", ctypes.c_int32), ("rope_table", ctypes.c_int32),
                ("kv_group", ctypes.c_int32), ("act", ctypes.c_int32)]


ACT_SILU, ACT_GELU_TANH = 0, 1  # decode_step.c's ACT_*
_ACTIVATIONS = {SiluAndMul: ACT_SILU, GeluTanhAndMul: ACT_GELU_TANH}
_NORMS = (RMSNorm, GemmaRMSNorm)  # both fused: `kernel_weight()` is what the kernel multiplies by


class _Ops(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("int_exact", "int_int8", "gguf_exact", "gguf_int8", "packed_f32", "attention")]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int32), ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("kv_kind", ctypes.c_int32), ("block_size", ctypes.c_int32),
                ("table_width", ctypes.c_int32), ("num_groups", ctypes.c_int32), ("hidden", ctypes.c_int64),
                ("intermediate", ctypes.c_int64), ("num_blocks", ctypes.c_int64), ("eps", ctypes.c_float),
                ("pad2", ctypes.c_float), ("final_norm", ctypes.c_void_p), ("seconds", ctypes.c_void_p)]


class _Plan(NamedTuple):
    """The model described for one row bucket (what decode_step.c reads), and what it depends on."""

    layers: ctypes.Array  # _Layer per decoder layer
    model: _Model
    norm_weights: list[torch.Tensor]  # the norms' kernel weights (Gemma's 1 + w), kept alive
    parts: list[StepPart]  # every projection part, for the scratch they need
    watched: list[tuple[torch.Tensor, int]]  # float weights with a kernel form, and their versions
    scratch_bytes: dict[int, int]  # rows -> the largest scratch a part needs (filled as steps come)
    rope_tables: list[int]  # each layer's rotary table index as last written into `layers`


def _address(fn) -> int:
    return 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def _layer_reason(i: int, layer: nn.Module) -> str | None:
    """Why decoder layer `i` is not one the C step describes (None: it is)."""
    attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
    if type(layer).forward not in (LlamaDecoderLayer.forward, Gemma2DecoderLayer.forward):
        return f"layer {i} ({type(layer).__name__}) computes its own forward"
    if type(attn).forward not in (LlamaAttention.forward, Qwen3Attention.forward):
        return f"layer {i}: attention {type(attn).__name__} computes its own forward"
    if not isinstance(mlp, LlamaMLP) or type(mlp).forward is not LlamaMLP.forward:
        return f"layer {i}: {type(mlp).__name__} is not a dense gated MLP (a mixture of experts runs eager)"
    if type(mlp.act_fn) not in _ACTIVATIONS:
        return f"layer {i}: activation {type(mlp.act_fn).__name__}"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if isinstance(layer, Gemma2DecoderLayer):
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if isinstance(attn, Qwen3Attention):
        norms += [attn.q_norm, attn.k_norm]
    if any(type(n) not in _NORMS for n in norms):
        return f"layer {i}: a norm other than RMSNorm / GemmaRMSNorm"
    if attn.attn.backend.name != "torch_paged":
        return f"layer {i}: attention backend {attn.attn.backend.name}"
    if any(m.lora is not None for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
        return "LoRA adapters on the layers"
    return None


def unsupported_reason(model: nn.Module, kv_caches: list[torch.Tensor]) -> str | None:
    """Why `model` cannot take C decode steps (None: it can, where each step's paths allow)."""
    if not envs.PAGEDLLM_DECODE_STEP:
        return f"{ENV}=0"
    if decode_step_kernel() is None or decode_softcap_kernel() is None:
        return "the C kernels are not available"
    if type(model).forward not in (LlamaForCausalLM.forward, Gemma2ForCausalLM.forward) or not isinstance(
            model.model, LlamaModel):
        return f"{type(model).__name__} is not a decoder the step describes"
    if model.tp.world_size != 1 or model.dtype != torch.float32:
        return "tensor parallelism or a dtype other than float32"
    inner = model.model
    # M-RoPE over 1-D positions (decode steps: position + rope delta) is plain RoPE (layers/mrope.py)
    if type(inner.norm) not in _NORMS or not isinstance(inner.rotary_emb, (RotaryEmbedding, MRotaryEmbedding)):
        return "a norm or rotary embedding other than RMSNorm / RoPE"
    for i, (layer, cache) in enumerate(zip(inner.layers, kv_caches, strict=True)):
        reason = _layer_reason(i, layer)
        if reason is not None:
            return reason
        if cache.device.type != "cpu" or cache.dtype not in KERNEL_KIND or not cache.is_contiguous():
            return f"a {cache.dtype} KV cache on {cache.device} (the step reads float32, bfloat16 and int8 caches)"
    if 2 * inner.rotary_emb.inv_freq.numel() != model.head_dim:
        return "partial rotary embedding"
    return None


def _rotary_tables(model: nn.Module, positions: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """This step's distinct `(cos, sin)` tables and each layer's index among them (Gemma 3: a
    local and a global table; the others: one). Decode positions need no metadata."""
    inner = model.model
    if not hasattr(inner, "rotary_tables"):  # one table for every layer
        return [inner.rotary_emb(positions)], [0] * len(inner.layers)
    per_layer = inner.rotary_tables(positions, None)
    tables: list[tuple[torch.Tensor, torch.Tensor]] = []
    index: dict[int, int] = {}
    which = []
    for table in per_layer:
        if id(table) not in index:
            index[id(table)] = len(tables)
            tables.append(table)
        which.append(index[id(table)])
    return tables, which


class CpuDecodeStep:
    """Runs decode-only steps of one model through decode_step.c (see the module docstring)."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.kernel = decode_step_kernel()
        # the products' functions are looked up when a plan needs them (a Q4_1 model never
        # builds gguf_gemm.c)
        self._ops = _Ops(attention=_address(decode_softcap_kernel()))
        self._plans: dict[int, tuple[tuple[int, int], _Plan | None]] = {}  # bucket -> ((choice generation, KV pointer), plan)
        self._work = torch.empty(0, dtype=torch.float32)
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.steps = 0  # steps run here (tests and the profile read it)
        # float64 [3]: seconds spent in the products, the attention and the small fused ops,
        # accumulated by the kernel while set (benchmarks/profile_step.py); None: not timed
        self.seconds: torch.Tensor | None = None

    @classmethod
    def create(cls, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int) -> "CpuDecodeStep | None":
        """The step for `model`, or None (logged once, with why) where it cannot run."""
        reason = unsupported_reason(model, kv_caches)
        if reason is not None:
            logger.info("Decode steps run the eager model: %s", reason)
            return None
        return cls(model, kv_caches, block_size)

    # ---- the plan: the model described once per row bucket -----------------------------------
    def _plan(self, bucket: int):
        """The plan for `bucket`, made again when a kernel choice changed, the KV caches were
        reallocated or a float weight changed in place (its kernel form is then re-made by the
        eager step first: None this once)."""
        stamp = (kernel_choice.generation(), self.kv_caches[0].data_ptr())
        cached = self._plans.get(bucket)
        if cached is not None and cached[0] == stamp:
            plan = cached[1]
            if plan is None or all(w._version == v for w, v in plan.watched):
                return plan
            self._plans.clear()
            return None
        plan = self._make_plan(bucket)
        self._plans[bucket] = (stamp, plan)
        return plan

    def _make_plan(self, bucket: int) -> _Plan | None:
        inner = self.model.model
        layers = (_Layer * len(inner.layers))()
        parts: list[StepPart] = []
        norm_weights: list[torch.Tensor] = []
        eps: set[float] = {inner.norm.variance_epsilon}

        def norm(module: nn.Module | None) -> int | None:
            if module is None:
                return None
            eps.add(module.variance_epsilon)
            weight = module.kernel_weight().contiguous()
            norm_weights.append(weight)
            return weight.data_ptr()

        for desc, layer, cache in zip(layers, inner.layers, self.kv_caches, strict=True):
            attn = layer.self_attn
            for field, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
                                  ("down", layer.mlp.down_proj)):
                linear_parts = module.method.decode_step_parts(module, bucket)
                if not linear_parts or len(linear_parts) > MAX_PARTS or not all(map(self._bind, linear_parts)):
                    return None
                parts += linear_parts
                _fill_linear(getattr(desc, field), module, linear_parts)
            key_cache, value_cache = split_kv_cache(cache, attn.num_kv_heads, attn.head_dim)
            gemma = isinstance(layer, Gemma2DecoderLayer)
            desc.input_norm = norm(layer.input_layernorm)
            desc.post_norm = norm(layer.post_attention_layernorm)
            desc.pre_ff_norm = norm(layer.pre_feedforward_layernorm if gemma else None)
            desc.post_ff_norm = norm(layer.post_feedforward_layernorm if gemma else None)
            desc.q_norm = norm(getattr(attn, "q_norm", None))
            desc.k_norm = norm(getattr(attn, "k_norm", None))
            desc.act = _ACTIVATIONS[type(layer.mlp.act_fn)]
            desc.key_cache, desc.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
            desc.scale = attn.attn.scale
            desc.softcap = attn.attn.logits_soft_cap or 0.0
            desc.window = attn.attn.sliding_window or 0
            desc.kv_group = attn.attn.kv_cache_group
        if len(eps) != 1:
            return None  # the C step takes one epsilon for every norm
        first = inner.layers[0].self_attn
        config = self.model.config
        model_desc = _Model(
            num_layers=len(inner.layers), num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, kv_kind=KERNEL_KIND[self.kv_caches[0].dtype], block_size=self.block_size,
            num_groups=1 + max(layer.kv_group for layer in layers),
            hidden=config.hidden_size, intermediate=inner.layers[0].mlp.down_proj.input_size,
            num_blocks=split_kv_cache(self.kv_caches[0], first.num_kv_heads, first.head_dim)[0].shape[0],
            eps=eps.pop(), final_norm=norm(inner.norm),
        )
        watched = [(m.weight, m.weight._version) for m in self.model.modules()
                   if (getattr(m, "prepared", None) is not None or isinstance(m, _NORMS))
                   and isinstance(getattr(m, "weight", None), torch.Tensor)]
        return _Plan(layers, model_desc, norm_weights, parts, watched, {}, [])

    # ---- one step ---------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor | None:
        """The final hidden states `[M, hidden]` of a decode-only step of M sequences (row i is
        sequence i; `attn_metadata` gives each KV cache group's slots, block tables and context
        lengths), or None where this step must run eager."""
        m = input_ids.shape[0]
        plan = self._plan(kernel_choice.bucket_index(m)) if m else None
        if plan is None:
            return None
        model_desc = plan.model
        groups = [attn_metadata.for_group(g) for g in range(model_desc.num_groups)]
        if any(md.decode_block_tables is None or md.decode_block_tables.shape[0] != m
               or md.decode_context_lens.shape[0] != m or md.slot_mapping.shape[0] != m for md in groups):
            return None
        hidden = self.model.embed_input_ids(input_ids)
        tables, which = _rotary_tables(self.model, positions)
        if which != plan.rope_tables:  # the same every step of a model: written into the plan once
            for desc, t in zip(plan.layers, which):
                desc.rope_table = t
            plan.rope_tables[:] = which
        cos, sin = _stacked([c for c, _ in tables]), _stacked([s for _, s in tables])
        slots = _stacked([md.slot_mapping.to(torch.int64) for md in groups])
        lens = _stacked([md.decode_context_lens.to(torch.int64) for md in groups])
        if len(groups) == 1:
            block_tables = groups[0].decode_block_tables.to(torch.int64).contiguous()
        else:  # one [groups, M, width] tensor, each group's tables padded to the widest
            block_tables = torch.zeros(len(groups), m, max(md.decode_block_tables.shape[1] for md in groups),
                                       dtype=torch.int64)
            for g, md in enumerate(groups):
                block_tables[g, :, : md.decode_block_tables.shape[1]] = md.decode_block_tables
        width = block_tables.shape[-1]
        model_desc.table_width = width
        model_desc.seconds = None if self.seconds is None else self.seconds.data_ptr()
        work = self._buffer("_work", self.kernel.work_floats(ctypes.byref(model_desc), m), torch.float32)
        scratch = self._buffer("_scratch", _scratch_for(plan, m), torch.uint8)
        out = torch.empty(m, model_desc.hidden, dtype=torch.float32)
        failed = self.kernel.run(
            ctypes.addressof(self._ops), ctypes.addressof(model_desc), ctypes.addressof(plan.layers), hidden.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
            work.data_ptr(), scratch.data_ptr(), m, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            logger.debug("C decode step refused its input (code %d): the step runs eager", failed)
            return None
        self.steps += 1
        return out

    def _bind(self, part: StepPart) -> bool:
        """Point the ops table at the function `part` needs (loading its library); False if absent."""
        field, loader, attr = _OP_FUNCTION[part.op]
        if getattr(self._ops, field) is None:
            kernel = loader()
            setattr(self._ops, field, _address(kernel and getattr(kernel, attr)) or None)
        return getattr(self._ops, field) is not None

    def _buffer(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self, name)
        if buf.numel() < size:
            buf = torch.empty(size, dtype=dtype)
            setattr(self, name, buf)
        return buf


# decode_step.c op code -> (the ops table's field, the library's loader, its function)
_OP_FUNCTION = {OP_INT_EXACT: ("int_exact", int_gemm_kernel, "exact"), OP_INT_INT8: ("int_int8", int_gemm_kernel, "int8"),
                OP_GGUF_EXACT: ("gguf_exact", gguf_gemm_kernel, "exact"),
                OP_GGUF_INT8: ("gguf_int8", gguf_gemm_kernel, "int8"),
                OP_PACKED_F32: ("packed_f32", packed_gemm_kernel, "gemm")}


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous tensor of `tensors` side by side (no copy beyond contiguity for one)."""
    return tensors[0].contiguous() if len(tensors) == 1 else torch.stack(tensors).contiguous()


def _scratch_for(plan: _Plan, m: int) -> int:
    """Bytes of scratch for a step of `m` rows under `plan` (once per row count)."""
    size = plan.scratch_bytes.get(m)
    if size is None:
        size = plan.scratch_bytes[m] = max([p.scratch_bytes(m) for p in plan.parts] + [64])
    return size


def _fill_linear(desc: _Linear, module: nn.Module, parts: list[StepPart]) -> None:
    desc.n_parts = len(parts)
    desc.out_features = sum(p.rows for p in parts)
    desc.in_features = parts[0].in_features
    desc.bias = module.bias.data_ptr() if module.bias is not None else None
    for slot, p in zip(desc.parts, parts):
        slot.op, slot.bits, slot.kind, slot.type = p.op, p.bits, p.kind, p.gguf_type
        slot.rows, slot.group_size, slot.weight = p.rows, p.group_size, p.weight.data_ptr()
