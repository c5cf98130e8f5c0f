"""layers/moe.py against plain references: the router's top-k math (softmax over all experts,
then top k, renormalised or not) token by token; the grouped expert computation (C-kernel
Linear layers) and the dense capture-safe one against a per-token loop of plain matrix
products; experts that get no token, no tokens at all, every expert hit once with all of its
rows; whole blocks against transformers 5.24's own Mixtral / Qwen2-MoE / Qwen3-MoE blocks; the
tensor-parallel split (the ranks' unreduced partial outputs sum to the whole block's); errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.moe import (
    ExpertMLP,
    MoeSpec,
    SparseMoeBlock,
    TopKRouter,
    dense_experts,
    grouped_experts,
    route_topk,
)

H, INTER, E = 64, 96, 8


def reference_route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[list[list[float]], list[list[int]]]:
    """Token by token, in Python: softmax of the row, the k largest (ties to the lower id), renormalised."""
    weights, ids = [], []
    for row in logits.double().tolist():
        m = max(row)
        exps = [pow(2.718281828459045, v - m) for v in row]
        total = sum(exps)
        probs = [x / total for x in exps]
        top = sorted(range(len(row)), key=lambda e: (-probs[e], e))[:k]
        w = [probs[e] for e in top]
        if renormalize:
            s = sum(w)
            w = [x / s for x in w]
        weights.append(w)
        ids.append(top)
    return weights, ids


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_route_topk_matches_per_token_reference(k, renormalize):
    torch.manual_seed(k)
    logits = torch.randn(37, E) * 3
    weights, ids = route_topk(logits, k, renormalize)
    ref_w, ref_ids = reference_route(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert ids.tolist() == ref_ids
    torch.testing.assert_close(weights.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    sums = weights.sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones(37))
    else:
        assert bool((sums < 1).all()) and float(sums.min()) < 0.9  # the other experts keep a part


def test_route_is_softmax_then_topk_not_topk_then_softmax():
    # Without renormalisation the weights are probabilities over *all* experts.
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    weights, ids = route_topk(logits, 2, renormalize=False)
    full = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(weights[0], full[:2])
    assert ids.tolist() == [[0, 1]]


def test_router_weight_dtype_and_bad_top_k():
    router = TopKRouter(H, E, 2, True, float32_weights=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(router.weight)
    w, _ = router(torch.randn(3, H, dtype=torch.bfloat16))
    assert w.dtype == torch.bfloat16  # Qwen: cast to the hidden dtype
    router32 = TopKRouter(H, E, 2, True, float32_weights=True, dtype=torch.bfloat16)
    router32.weight.data.copy_(router.weight)
    assert router32(torch.randn(3, H, dtype=torch.bfloat16))[0].dtype == torch.float32  # Mixtral
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be in 1\.\.8"):
        TopKRouter(H, E, 9, True, True)
    with pytest.raises(ValueError, match=r"top_k=0"):
        route_topk(torch.randn(2, E), 0, True)


def make_experts(n: int = E, seed: int = 0, inter: int = INTER) -> list[ExpertMLP]:
    torch.manual_seed(seed)
    experts = []
    for _ in range(n):
        ex = ExpertMLP(H, inter, "silu", torch.float32, "cpu")
        ex.gate_up_proj.weight.data.normal_(0, 0.2)
        ex.down_proj.weight.data.normal_(0, 0.2)
        ex.gate_up_proj.process_weights_after_loading()
        ex.down_proj.process_weights_after_loading()
        experts.append(ex)
    return experts


def reference_experts(x, weights, ids, experts) -> torch.Tensor:
    """A per-token loop of plain products: sum_j w[t, j] * down(silu(gate x) * up x)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = experts[int(ids[t, j])]
            gu = x[t] @ ex.gate_up_proj.weight.T
            gate, up = gu.chunk(2)
            out[t] += float(weights[t, j]) * ((F.silu(gate) * up) @ ex.down_proj.weight.T)
    return out


def random_routing(tokens: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return route_topk(torch.randn(tokens, E) * 2, k, True)


@pytest.mark.parametrize("tokens,k", [(1, 2), (5, 2), (64, 2), (33, 4), (200, 1)])
def test_grouped_and_dense_equal_per_token_reference(tokens, k):
    experts = make_experts()
    assert experts[0].gate_up_proj.prepared is not None or experts[0].gate_up_proj.weight is not None
    x = torch.randn(tokens, H)
    weights, ids = random_routing(tokens, k)
    ref = reference_experts(x, weights, ids, experts)
    torch.testing.assert_close(grouped_experts(x, weights, ids, experts), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense_experts(x, weights, ids, experts), ref, rtol=1e-5, atol=1e-5)


class CallLog:
    """Forward hooks that record how many rows each expert ran on, call by call."""

    def __init__(self, experts):
        self.rows: dict[int, list[int]] = {}
        self.handles = [ex.register_forward_hook(self._hook(e)) for e, ex in enumerate(experts)]

    def _hook(self, e):
        def hook(module, args, output):
            self.rows.setdefault(e, []).append(args[0].shape[0])
        return hook


def test_experts_without_tokens_are_skipped_and_no_tokens_is_empty():
    experts = make_experts()
    log = CallLog(experts)
    x = torch.randn(6, H)
    ids = torch.tensor([[0, 3], [3, 0], [0, 3], [3, 5], [0, 5], [5, 3]])
    weights = torch.rand(6, 2)
    out = grouped_experts(x, weights, ids, experts)
    torch.testing.assert_close(out, reference_experts(x, weights, ids, experts), rtol=1e-5, atol=1e-5)
    assert log.rows == {0: [4], 3: [5], 5: [3]}  # one batched call per expert that has tokens, no others
    # a token whose routing weights are zero gets nothing from the experts
    weights[2] = 0.0
    assert float(grouped_experts(x, weights, ids, experts)[2].abs().max()) == 0.0
    empty = grouped_experts(torch.randn(0, H), torch.rand(0, 2), torch.zeros(0, 2, dtype=torch.int64), experts)
    assert empty.shape == (0, H)


def test_all_experts_hit_once_each_with_all_their_rows():
    experts = make_experts()
    log = CallLog(experts)
    x = torch.randn(50, H)
    weights, ids = random_routing(50, 2, seed=3)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    assert all(counts), counts  # the routing hits every expert
    out = grouped_experts(x, weights, ids, experts)
    assert log.rows == {e: [counts[e]] for e in range(E)}
    torch.testing.assert_close(out, reference_experts(x, weights, ids, experts), rtol=1e-5, atol=1e-5)


def test_bad_routing_is_a_value_error():
    experts = make_experts(4)
    x = torch.randn(3, H)
    with pytest.raises(ValueError, match=r"expert ids \[0, 4\], the layer has 4 experts"):
        grouped_experts(x, torch.rand(3, 1), torch.tensor([[0], [4], [0]]), experts)
    with pytest.raises(ValueError, match=r"expert ids \[-1, 0\]"):
        grouped_experts(x, torch.rand(3, 1), torch.tensor([[0], [-1], [0]]), experts)
    with pytest.raises(ValueError, match=r"expert ids \[1, 7\], the layer has 4 experts"):  # one token
        grouped_experts(x[:1], torch.rand(1, 2), torch.tensor([[7, 1]]), experts)
    with pytest.raises(ValueError, match=r"must be \[T, H\], \[T, k\], \[T, k\]"):
        grouped_experts(x, torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int64), experts)


# ---- whole blocks vs transformers' ---------------------------------------------------------
def _hf_block(kind: str, **overrides):
    import transformers as tf

    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(**base, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=2)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**base, intermediate_size=128, moe_intermediate_size=INTER, num_experts=E,
                                num_experts_per_tok=4, shared_expert_intermediate_size=80, **overrides)
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
    else:
        cfg = tf.Qwen3MoeConfig(**base, intermediate_size=128, moe_intermediate_size=INTER, num_experts=E,
                                num_experts_per_tok=2, **overrides)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    torch.manual_seed(7)
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return cfg, block


def _spec(kind: str, cfg) -> MoeSpec:
    if kind == "mixtral":
        from pagedllm.model.mixtral import mixtral_spec

        return mixtral_spec(cfg)
    from pagedllm.model.qwen2_moe import Qwen2MoeDecoderLayer
    from pagedllm.model.qwen3_moe import Qwen3MoeDecoderLayer

    return (Qwen2MoeDecoderLayer if kind == "qwen2_moe" else Qwen3MoeDecoderLayer).moe_spec(cfg)


def _load_block(ours: SparseMoeBlock, theirs, rank: int = 0, world: int = 1) -> None:
    """Copy transformers' block (fused experts) into ours, this rank's part of each expert."""
    inter = ours.spec.intermediate_size
    start, local = rank * inter // world, inter // world
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, ex in enumerate(ours.experts):
            gu = theirs.experts.gate_up_proj[e]
            ex.gate_up_proj.load_shard(0, "weight", gu[start:start + local])
            ex.gate_up_proj.load_shard(1, "weight", gu[inter + start:inter + start + local])
            ex.down_proj.load_weight("weight", theirs.experts.down_proj[e][:, start:start + local])
        if ours.shared_expert is not None:
            s_inter = ours.spec.shared_expert_size
            s0, sl = rank * s_inter // world, s_inter // world
            sh = theirs.shared_expert
            ours.shared_expert.gate_up_proj.load_shard(0, "weight", sh.gate_proj.weight[s0:s0 + sl])
            ours.shared_expert.gate_up_proj.load_shard(1, "weight", sh.up_proj.weight[s0:s0 + sl])
            ours.shared_expert.down_proj.load_weight("weight", sh.down_proj.weight[:, s0:s0 + sl])
            ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)
    for m in ours.modules():
        if hasattr(m, "process_weights_after_loading") and m is not ours:
            m.process_weights_after_loading()


BLOCKS = {"mixtral": {}, "qwen2_moe": {}, "qwen2_moe-norm": dict(norm_topk_prob=True),
          "qwen3_moe-norm": dict(norm_topk_prob=True), "qwen3_moe": dict(norm_topk_prob=False)}


@pytest.mark.parametrize("case", list(BLOCKS))
def test_block_matches_transformers(case):
    kind = case.split("-")[0]
    cfg, theirs = _hf_block(kind, **BLOCKS[case])
    ours = SparseMoeBlock(cfg, _spec(kind, cfg), torch.float32, "cpu", prefix="model.layers.0.mlp")
    assert (ours.shared_expert is not None) == (kind == "qwen2_moe")
    _load_block(ours, theirs)
    x = torch.randn(2, 23, H)
    with torch.no_grad():
        ref = theirs(x)
        got = ours(x.reshape(-1, H)).reshape(2, 23, H)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_tensor_parallel_partial_outputs_sum_to_the_whole_block(kind):
    cfg, theirs = _hf_block(kind)
    whole = SparseMoeBlock(cfg, _spec(kind, cfg), torch.float32, "cpu", prefix="model.layers.0.mlp")
    _load_block(whole, theirs)
    x = torch.randn(40, H)
    parts = []
    for rank in range(2):
        # no process group: all_reduce_sum is the identity, so forward returns this rank's partial sum
        block = SparseMoeBlock(cfg, _spec(kind, cfg), torch.float32, "cpu", prefix="model.layers.0.mlp",
                               tp=TensorParallelGroup(rank, 2, "gloo"))
        assert block.experts[0].gate_up_proj.output_sizes == [INTER // 2] * 2
        assert block.experts[0].down_proj.tp_shard.in_range == (rank * INTER // 2, INTER // 2)
        _load_block(block, theirs, rank, 2)
        with torch.no_grad():
            parts.append(block(x))
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], whole(x), rtol=1e-5, atol=2e-5)
    assert float((parts[0] - whole(x)).abs().max()) > 1e-3  # each rank alone is only a part


def test_check_tensor_parallel_names_the_expert_sizes():
    import transformers as tf

    from pagedllm.model.mixtral import MixtralForCausalLM
    from pagedllm.model.qwen2_moe import Qwen2MoeForCausalLM
    from pagedllm.model.qwen3_moe import Qwen3MoeForCausalLM

    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_hidden_layers=2)
    mixtral = tf.MixtralConfig(**base, intermediate_size=90)
    MixtralForCausalLM.check_tensor_parallel(mixtral, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: each expert's intermediate size of 90"):
        MixtralForCausalLM.check_tensor_parallel(mixtral, 4)
    qwen2 = tf.Qwen2MoeConfig(**base, intermediate_size=128, moe_intermediate_size=96,
                              shared_expert_intermediate_size=90, num_experts=4)
    with pytest.raises(ValueError, match=r"the shared expert's intermediate size of 90"):
        Qwen2MoeForCausalLM.check_tensor_parallel(qwen2, 4)
    # dense intermediate size 90 is not used when every layer is sparse: no error
    qwen3 = tf.Qwen3MoeConfig(**base, intermediate_size=90, moe_intermediate_size=96, num_experts=4)
    Qwen3MoeForCausalLM.check_tensor_parallel(qwen3, 4)
    qwen3_dense = tf.Qwen3MoeConfig(**base, intermediate_size=90, moe_intermediate_size=96, num_experts=4,
                                    mlp_only_layers=[1])
    with pytest.raises(ValueError, match=r"the dense layers' intermediate size of 90"):
        Qwen3MoeForCausalLM.check_tensor_parallel(qwen3_dense, 4)
    wide = tf.Qwen3MoeConfig(**(base | dict(num_attention_heads=8, num_key_value_heads=8)), intermediate_size=128,
                             moe_intermediate_size=36, num_experts=4)
    with pytest.raises(ValueError, match=r"each expert's intermediate size \(moe_intermediate_size\) of 36"):
        Qwen3MoeForCausalLM.check_tensor_parallel(wide, 8)


def test_benchmark_variants_agree_and_report_ratios():
    """benchmarks/moe.py on tiny shapes: it checks every variant's output against ours first."""
    from benchmarks.moe import main

    result = main(["--hidden", "64", "--intermediate", "96", "--tokens", "1", "9", "--iters", "1", "--repeats", "2"])
    variants = {(r["tokens"], r["variant"]) for r in result["rows"]}
    assert variants == {(t, v) for t in (1, 9) for v in ("pagedllm", "dense", "transformers", "per-token")}
    assert all(r["ratio"] == 1.0 for r in result["rows"] if r["variant"] == "pagedllm")
    assert all(len(r["runs_ms"]) == 2 and r["ms"] > 0 for r in result["rows"])
