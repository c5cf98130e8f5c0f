"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE).

Routing, as transformers 5.24 computes it (`MixtralTopKRouter`, `Qwen2MoeTopKRouter`): router
logits `x W^T`, softmax over *all* experts in float32, the top k probabilities, renormalised to
sum 1 when `renormalize` (Mixtral always; Qwen's `norm_topk_prob`). Mixtral multiplies the expert
outputs by the float32 weights; Qwen first casts them to the hidden dtype (`float32_weights`).

Experts run grouped: the `tokens x k` (token, expert) pairs are sorted by expert (one stable
argsort), each expert that got tokens runs once on all of its rows (gate/up, activation, down:
two matrix products), the outputs are scaled by their routing weights and scattered back with
one `index_add_`. The only host synchronisation is the per-expert row count. Each expert is a
pair of `Linear` layers, so a float expert multiplies through the C kernels' prepared form
(`prepare_weight`, made once in `process_weights_after_loading`) and a quantized checkpoint's
expert through its `layers/quantization` method, as any dense projection.

A CUDA graph capture may not read counts to the host: while capturing, every expert runs on every
token, weighted by a `[tokens, experts]` matrix that is zero off the chosen experts
(`dense_experts`); same result, more arithmetic. Under torch.compile (compiled CPU decode
graphs) the grouped computation is left out of the graph (`torch.compiler.disable`, applied by
layers/eager_in_graphs.py): the rest of the step is compiled, the experts run eagerly on the C
kernels, and no count recompiles.

Tensor parallelism splits each expert's intermediate size (gate/up column-parallel, down
row-parallel, as LlamaMLP); the router and Qwen2's `shared_expert_gate` are replicated, so every
rank routes alike, and the block sums the experts' (and the shared expert's) partial outputs
with one all-reduce.

Checkpoint forms: the Hub stores one tensor per expert (`experts.E.gate_proj.weight` or
Mixtral's `w1`/`w3`/`w2`); transformers 5 holds experts fused (`experts.gate_up_proj [E, 2I, H]`,
gate rows first, `experts.down_proj [E, H, I]`) and writes that form with
`save_pretrained(save_original_format=False)` (the default writes the Hub's). `FusedExperts`
turns the fused tensors into the per-expert ones (this rank's part of them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.sharding import column_shard, row_shard, shard_range
from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.eager_in_graphs import eager_in_graphs
from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.quantization.formats.base import QuantizationConfig

SINGLE = TensorParallelGroup(0, 1, "none")


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights [T, k] float32, expert ids [T, k] int64)`: softmax over all experts in float32,
    the top k, renormalised to sum 1 when `renormalize`."""
    if router_logits.dim() != 2:
        raise ValueError(f"route_topk: router logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    if not 0 < top_k <= router_logits.shape[1]:
        raise ValueError(f"route_topk: top_k={top_k} must be in 1..{router_logits.shape[1]} (the number of experts)")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


class TopKRouter(Linear):
    """The router (`gate`): a float `[experts, hidden]` projection (the C kernels' form on CPU,
    never quantized) whose forward returns the routing `(weights, ids)` of `route_topk`; weights in
    float32 (`float32_weights`, Mixtral) or in the logits' dtype (Qwen)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, float32_weights: bool,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts} (the number of experts)")
        super().__init__(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.top_k = top_k
        self.renormalize = renormalize
        self.float32_weights = float32_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        weights, ids = route_topk(logits, self.top_k, self.renormalize)
        return (weights if self.float32_weights else weights.to(logits.dtype)), ids

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}, renormalize={self.renormalize}"


class ExpertMLP(nn.Module):
    """One gated expert: `down(act(gate) * up)`, gate/up fused. Under tensor parallelism it holds
    its rank's part of the intermediate size and its down projection's partial sums are left
    unreduced: the block reduces all experts at once."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype | None,
                 device: torch.device | str | None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", checkpoint_names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
                 checkpoint_prefix: str | None = None, tp: TensorParallelGroup = SINGLE) -> None:
        """`prefix` is our module name, `checkpoint_prefix` the checkpoint's (Mixtral's
        `block_sparse_moe.experts.E`), `checkpoint_names` its gate, up and down projections:
        a quantization config decides by those names (ignore lists, per-module schemes)."""
        super().__init__()
        gate_up_shard = down_shard = None
        local = intermediate_size
        if tp.world_size > 1:
            what = "an expert's intermediate size"
            start, local = shard_range(intermediate_size, tp.rank, tp.world_size, what)
            gate_up_shard = column_shard([intermediate_size] * 2, [(start, local)] * 2, hidden_size)
            down_shard = row_shard(intermediate_size, hidden_size, tp.rank, tp.world_size, what)
        ck = checkpoint_prefix if checkpoint_prefix is not None else prefix
        gate, up, down = checkpoint_names
        gate_up_method = down_method = None
        if quant_config is not None:
            gate_up_method = quant_config.get_linear_method(f"{prefix}.gate_up_proj", [f"{ck}.{gate}", f"{ck}.{up}"])
            down_method = quant_config.get_linear_method(f"{prefix}.down_proj", [f"{ck}.{down}"])
        self.gate_up_proj = MergedLinear(hidden_size, [local, local], dtype=dtype, device=device,
                                         quant_method=gate_up_method, tp_shard=gate_up_shard)
        self.down_proj = Linear(local, hidden_size, dtype=dtype, device=device, quant_method=down_method,
                                tp_shard=down_shard)
        self.act_fn = get_act_and_mul(hidden_act)
        self.intermediate_size = intermediate_size  # the whole expert's (every rank's part together)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def _check_routing(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"experts: hidden {tuple(x.shape)}, routing weights {tuple(weights.shape)} and ids "
                         f"{tuple(ids.shape)} must be [T, H], [T, k], [T, k]")


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: Sequence[nn.Module]) -> torch.Tensor:
    """`sum_j weights[t, j] * experts[ids[t, j]](x[t])` for every token `t`, each expert run once on
    all of its tokens (sorted by expert; see the module docstring). Experts with no token are
    skipped; an id outside `0 .. len(experts) - 1` is a ValueError."""
    _check_routing(x, weights, ids)
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    if x.shape[0] == 1:  # one token (a single decode): its k experts directly, no sort or scatter
        return _one_token(x, weights, ids, experts, out)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=len(experts)) if int(flat.min()) >= 0 else None
    if counts is None or counts.numel() != len(experts):
        raise ValueError(f"experts: routing chose expert ids {sorted(set(flat.tolist()))}, the layer has "
                         f"{len(experts)} experts (0..{len(experts) - 1})")
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    rows = x.index_select(0, token_of)
    outputs = []
    start = 0
    for expert, n in zip(experts, counts.tolist()):
        if n:
            outputs.append(expert(rows[start:start + n]))
            start += n
    scaled = torch.cat(outputs) * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return out.index_add_(0, token_of, scaled.to(out.dtype))


def _one_token(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Sequence[nn.Module],
               out: torch.Tensor) -> torch.Tensor:
    chosen = ids[0].tolist()
    if min(chosen) < 0 or max(chosen) >= len(experts):
        raise ValueError(f"experts: routing chose expert ids {sorted(set(chosen))}, the layer has "
                         f"{len(experts)} experts (0..{len(experts) - 1})")
    for j, e in enumerate(chosen):
        out += (experts[e](x) * weights[:, j:j + 1]).to(out.dtype)
    return out


def dense_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  experts: Sequence[nn.Module]) -> torch.Tensor:
    """`grouped_experts` without any host synchronisation (CUDA graph capture): every expert on
    every token, weighted by a `[T, experts]` matrix that is zero off the chosen experts."""
    _check_routing(x, weights, ids)
    dense = torch.zeros(x.shape[0], len(experts), dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        out += (expert(x) * dense[:, e:e + 1]).to(out.dtype)
    return out


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# Under torch.compile (the CPU's compiled decode graphs) the grouped experts stay eager: traced,
# every new set of per-expert counts would be a recompilation; eager, they keep the C kernels.
_grouped_outside_compile = eager_in_graphs(grouped_experts)


class MoeSpec(NamedTuple):
    """What an architecture's config says about its sparse blocks."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    renormalize: bool
    float32_weights: bool  # routing weights applied in float32 (Mixtral) or the hidden dtype (Qwen)
    shared_expert_size: int | None = None  # Qwen2-MoE's shared expert (with its sigmoid gate)
    checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    checkpoint_block: str = "mlp"  # the block's name in checkpoint tensor names (Mixtral: block_sparse_moe)


class SparseMoeBlock(nn.Module):
    """Router (`gate`), routed `experts`, and optionally a `shared_expert` scaled by
    `sigmoid(shared_expert_gate(x))` (Qwen2-MoE), summed; one all-reduce under tensor
    parallelism."""

    def __init__(self, config: Any, spec: MoeSpec, dtype: torch.dtype, device: torch.device | str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        if spec.num_experts < 1:
            raise ValueError(f"a sparse MoE block needs at least one expert, the config has {spec.num_experts}")
        self.spec = spec
        self.tp = tp
        self.gate = TopKRouter(hidden, spec.num_experts, spec.top_k, spec.renormalize, spec.float32_weights,
                               dtype=dtype, device=device)
        layer_prefix = prefix.rpartition(".")[0]
        ck_block = f"{layer_prefix}.{spec.checkpoint_block}"
        self.experts = nn.ModuleList(
            ExpertMLP(hidden, spec.intermediate_size, config.hidden_act, dtype, device, quant_config,
                      f"{prefix}.experts.{e}", spec.checkpoint_names, f"{ck_block}.experts.{e}", tp)
            for e in range(spec.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_size:
            self.shared_expert = ExpertMLP(hidden, spec.shared_expert_size, config.hidden_act, dtype, device,
                                           quant_config, f"{prefix}.shared_expert", tp=tp)
            self.shared_expert_gate = Linear(hidden, 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        run = dense_experts if _capturing(x) else _grouped_outside_compile
        out = run(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return parallel_state.all_reduce_sum(out) if self.tp.world_size > 1 else out


class FusedExperts:
    """Checkpoint tensors of transformers 5's fused in-memory form, made per expert.

    `model.layers.N.mlp.experts.gate_up_proj [E, 2I, H]` -> `...experts.e.gate_proj.weight`,
    `...experts.e.up_proj.weight`; `...experts.down_proj [E, H, I]` -> `...experts.e.down_proj.weight`
    (names after the model's renaming, i.e. ours). Under tensor parallelism each is cut to this
    rank's part of the intermediate size (`slices`: the loader cuts down_proj before reading;
    gate_up_proj, whose part is two ranges, is read whole and cut here). A layer given both
    forms, a wrong shape or a fused tensor for a quantized layer is a ValueError."""

    SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.forms: dict[str, str] = {}  # block name -> "fused" / "per-expert"

    @classmethod
    def is_fused(cls, name: str) -> bool:
        return name.endswith(cls.SUFFIXES)

    def _block(self, name: str) -> tuple[str, SparseMoeBlock]:
        block_name = name.rsplit(".experts.", 1)[0]
        block = self.modules.get(block_name)
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(f"Unexpected weight {name!r} in checkpoint (no mixture-of-experts block {block_name})")
        return block_name, block

    def _part(self, block: SparseMoeBlock) -> tuple[int, int]:
        """(start, length) of this rank's part of an expert's intermediate size."""
        shard = block.experts[0].down_proj.tp_shard
        return shard.in_range if shard is not None else (0, block.spec.intermediate_size)

    def slices(self, name: str) -> list[tuple[int, int, int]]:
        """The loader's cuts of a fused tensor (empty: all of it)."""
        _, block = self._block(name)
        if not name.endswith(".experts.down_proj") or block.tp.world_size == 1:
            return []
        start, length = self._part(block)
        return [(2, start, length)]

    def note(self, name: str, form: str) -> None:
        """Record that a tensor of `form` came for the block of `name`; both forms for one block
        would load its experts twice."""
        if ".experts." not in name:
            return
        block_name = name.rsplit(".experts.", 1)[0]
        if not isinstance(self.modules.get(block_name), SparseMoeBlock):
            return  # not an expert tensor (load_weights names the unknown ones)
        seen = self.forms.setdefault(block_name, form)
        if seen != form:
            raise ValueError(f"Checkpoint has both per-expert and fused expert tensors for {block_name} "
                             f"(e.g. {name!r}); it must use one form")

    def split(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        block_name, block = self._block(name)
        self.note(name, "fused")
        spec, expert0 = block.spec, block.experts[0]
        if expert0.gate_up_proj.quant_method is not None or expert0.down_proj.quant_method is not None:
            raise ValueError(f"Checkpoint tensor {name!r} is a fused float expert tensor, but {block_name}'s experts "
                             "are quantized; a quantized checkpoint must store its experts per expert")
        hidden, inter, num = block.gate.input_size, spec.intermediate_size, spec.num_experts
        start, length = self._part(block)
        shape = tuple(tensor.shape)
        if name.endswith(".experts.gate_up_proj"):
            if shape != (num, 2 * inter, hidden):
                raise ValueError(f"Shape mismatch loading {name}: checkpoint has {shape}, model expects "
                                 f"{(num, 2 * inter, hidden)} (experts, gate + up rows, hidden)")
            for e in range(num):
                yield f"{block_name}.experts.{e}.gate_proj.weight", tensor[e, start:start + length]
                yield f"{block_name}.experts.{e}.up_proj.weight", tensor[e, inter + start:inter + start + length]
            return
        if shape == (num, hidden, inter) and length != inter:
            tensor, shape = tensor[:, :, start:start + length], (num, hidden, length)  # read whole: cut here
        if shape != (num, hidden, length):
            raise ValueError(f"Shape mismatch loading {name}: checkpoint has {shape}, model expects "
                             f"{(num, hidden, inter)} (experts, hidden, intermediate)")
        for e in range(num):
            yield f"{block_name}.experts.{e}.down_proj.weight", tensor[e]


class MoeCheckpointMixin:
    """`load_weights` / `checkpoint_slices` of a LlamaForCausalLM subclass with sparse blocks:
    checkpoint names renamed to ours (`to_model_name`; Mixtral's `block_sparse_moe.experts.E.w1`),
    the fused form made per expert, and a shape error named by the checkpoint's tensor."""

    def to_model_name(self, name: str) -> str:
        """A checkpoint tensor's name as our parameters spell it (identity here)."""
        return name

    def _fused(self) -> FusedExperts:
        return FusedExperts(dict(self.named_modules()))  # type: ignore[attr-defined]

    def checkpoint_slices(self, name: str, shape: tuple[int, ...] | None = None) -> list[tuple[int, int, int]]:
        name = self.to_model_name(name)
        if FusedExperts.is_fused(name):
            if self.tp.world_size == 1:  # type: ignore[attr-defined]
                return []
            fused = self.__dict__.get("_fused_slicer") or self.__dict__.setdefault("_fused_slicer", self._fused())
            return fused.slices(name)
        return super().checkpoint_slices(name, shape)  # type: ignore[misc]

    def _model_weights(self, weights: Iterable[tuple[str, torch.Tensor]], fused: FusedExperts,
                       state: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        for ck_name, tensor in weights:
            name = self.to_model_name(ck_name)
            state["current"] = ck_name
            if FusedExperts.is_fused(name):
                yield from fused.split(name, tensor)
            else:
                fused.note(name, "per-expert")
                yield name, tensor
        state["current"] = None  # every tensor read: what fails now is the missing-weights check

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state: dict[str, Any] = {"current": None}
        try:
            super().load_weights(self._model_weights(weights, self._fused(), state))  # type: ignore[misc]
        except ValueError as e:
            current = state["current"]
            if current is None or current in str(e):
                raise
            raise ValueError(f"Loading {current}: {e}") from e
