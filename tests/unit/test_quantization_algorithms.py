"""The calibrated quantization methods on small random matrices (pagedllm/quantization/algorithms/):
GPTQ against round to nearest on its own objective, act-order's g_idx, AWQ's scale and clip
searches, AWQ's scale folding (the float model must not change), the calibration Llama layer
against transformers, and the calibration windows / shipped texts."""

from __future__ import annotations

import pytest
import torch

from pagedllm.quantization.algorithms import awq
from pagedllm.quantization.algorithms.block import BlockShape, Rope, attention_core, layer_weights, linear, mlp_act, rms_norm
from pagedllm.quantization.algorithms.calibration import CALIBRATION, HELDOUT, shipped_text, token_windows
from pagedllm.quantization.algorithms.gptq import accumulate_hessian, gptq_quantize, hessian_order
from pagedllm.quantization.algorithms.grid import fake_quantize, rtn_quantize
from pagedllm.quantization.algorithms.pipeline import Grid, awq_model


def correlated_inputs(n: int, k: int, seed: int, draw: int = 0) -> torch.Tensor:
    """Inputs with correlated channels and uneven channel magnitudes, as real activations
    (`seed` fixes the distribution, `draw` the samples)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k // 4, k, generator=g)
    scale = torch.exp(torch.randn(k, generator=g))
    g = torch.Generator().manual_seed(1000 + draw)
    z = torch.randn(n, k // 4, generator=g)
    return (z @ mix + 0.3 * torch.randn(n, k, generator=g)) * scale


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float((x @ (w - wq).t()).pow(2).mean())


@pytest.mark.parametrize("bits,gs,sym,act_order", [(4, 32, True, False), (4, 32, False, True), (4, -1, True, True),
                                                   (8, 64, False, False), (4, 16, True, True)])
def test_gptq_beats_rtn_on_calibration_inputs(bits, gs, sym, act_order):
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    x = correlated_inputs(1024, 128, seed=1)
    H = 2 * x.t() @ x / x.shape[0]
    q = gptq_quantize(w, H, bits, gs, sym, act_order=act_order, block_size=32)
    rtn = fake_quantize(w, bits, gs, sym)
    err_gptq, err_rtn = output_error(x, w, q.dequantize()), output_error(x, w, rtn)
    assert err_gptq < 0.6 * err_rtn, (err_gptq, err_rtn)
    x_new = correlated_inputs(1024, 128, seed=1, draw=1)  # fresh inputs of the same distribution
    assert output_error(x_new, w, q.dequantize()) < output_error(x_new, w, rtn)
    codes = q.codes
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) < 1 << bits


def test_gptq_with_a_diagonal_hessian_is_rtn():
    """No correlation between inputs: nothing to compensate, GPTQ must round to nearest exactly."""
    torch.manual_seed(2)
    w = torch.randn(16, 64)
    H = torch.diag(torch.rand(64) + 0.5)
    for sym in (True, False):
        q = gptq_quantize(w, H, 4, 16, sym)
        codes, scales, zeros = rtn_quantize(w, 4, 16, sym)
        assert torch.equal(q.codes, codes) and torch.equal(q.scales, scales) and torch.equal(q.zeros, zeros)


def test_act_order_g_idx_follows_the_hessian_diagonal():
    torch.manual_seed(3)
    k, gs = 96, 16
    w = torch.randn(8, k)
    x = correlated_inputs(256, k, seed=4)
    H = 2 * x.t() @ x / x.shape[0]
    q = gptq_quantize(w, H, 4, gs, sym=True, act_order=True)
    perm = hessian_order(H)
    assert sorted(perm.tolist()) == list(range(k))
    d = torch.diagonal(H)[perm]
    assert bool((d[:-1] >= d[1:]).all())
    # the j-th column in descending-diag order lies in group j // gs: groups in that order
    assert torch.equal(q.g_idx[perm], torch.arange(k, dtype=torch.int32) // gs)
    assert torch.bincount(q.g_idx.long()).tolist() == [gs] * (k // gs)
    assert not torch.equal(q.g_idx, torch.arange(k, dtype=torch.int32) // gs)  # a real permutation here


def test_gptq_dead_inputs_and_hessian_accumulation():
    torch.manual_seed(5)
    x = correlated_inputs(64, 32, seed=6)
    x[:, 3] = 0  # an input that is never active
    xtx = accumulate_hessian(None, x[:40])
    xtx = accumulate_hessian(xtx, x[40:].reshape(2, 12, 32))
    assert torch.allclose(xtx, (x.t() @ x).double(), rtol=1e-5, atol=1e-3)
    q = gptq_quantize(torch.randn(8, 32), 2 * xtx / 64, 4, 8, sym=False)
    assert torch.equal(q.dequantize()[:, 3], torch.zeros(8))


def test_awq_scale_search_never_worse_than_rtn_or_alpha_zero():
    torch.manual_seed(7)
    k = 128
    x = torch.randn(512, k)
    x[:, :4] *= 30  # a few salient input channels, as in LLM activations
    weights = {"a": torch.randn(64, k), "b": torch.randn(32, k)}

    def forward(ws):
        return torch.cat([x @ ws["a"].t(), x @ ws["b"].t()], dim=1)

    ref = forward(weights)
    quant = Grid(4, 32, sym=False).fake
    s, loss, history = awq.search_scales(x.abs().mean(0), weights, forward, ref, quant, 32, n_grid=20)
    assert len(history) == 21 and history[0][0] is None and [a for a, _ in history[1:]] == [i / 20 for i in range(20)]
    rtn_loss = float((forward({n: quant(w) for n, w in weights.items()}) - ref).pow(2).mean())
    assert history[0][1] == pytest.approx(rtn_loss, rel=1e-6)
    s0 = awq.candidate_scales(x.abs().mean(0), awq.weight_mean(list(weights.values()), 32), 0.0)
    alpha0_loss = float((forward({n: quant(w * s0) / s0 for n, w in weights.items()}) - ref).pow(2).mean())
    assert loss <= min(rtn_loss, alpha0_loss) and loss == min(v for _, v in history)
    assert loss < 0.7 * rtn_loss, (loss, rtn_loss)  # salient channels: the scales help clearly
    assert s[:4].min() > s[4:].max()  # and they grow the salient channels


def test_awq_clip_search_lowers_each_groups_error():
    torch.manual_seed(8)
    w = torch.distributions.StudentT(3.0).sample((40, 64))  # heavy tails, as LLM weights
    x = torch.randn(700, 64)
    quant = Grid(4, 16, sym=False).fake
    best = awq.search_clip(w, x, quant, 16, rows_per_batch=16)
    assert best.shape == (40, 4)
    org = w.reshape(40, 4, 16).abs().amax(-1)
    assert bool((best <= org + 1e-6).all()) and bool((best >= 0.5 * org - 1e-6).all())
    assert int((best < org - 1e-6).sum()) > 10  # many groups are clipped
    xs = x[:: max(1, 700 // 512)][:512]

    def group_err(wq):
        return ((xs.reshape(-1, 4, 16).unsqueeze(1) * (w - wq).reshape(40, 4, 16)).sum(-1)).pow(2).mean(0)

    err_clip = group_err(quant(awq.apply_clip(w, best, 16)))
    err_none = group_err(quant(w))
    assert bool((err_clip <= err_none + 1e-5).all()) and float(err_clip.sum()) < float(err_none.sum())


def tiny_weights(num_kv_heads: int, seed: int = 0):
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=128,
                            tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.2) + (1.0 if "norm" in name else 0.0))
    return config, model, {n: t.detach().clone() for n, t in model.state_dict().items()}


def block_forward(weights, config, ids) -> list[torch.Tensor]:
    """Each layer's output hidden state by the calibration block's pieces."""
    shape, rope = BlockShape.from_config(config), Rope(config)
    h = weights["model.embed_tokens.weight"][ids]
    outs = []
    for i in range(config.num_hidden_layers):
        w = layer_weights(weights, i)
        h = h + linear(attention_core(rms_norm(h, w["input_layernorm.weight"], shape.eps), w, shape, rope), w, "o_proj")
        h = h + linear(mlp_act(rms_norm(h, w["post_attention_layernorm.weight"], shape.eps), w), w, "down_proj")
        outs.append(h)
    return outs


def test_calibration_block_equals_transformers():
    config, model, weights = tiny_weights(num_kv_heads=2)
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True).hidden_states
    ours = block_forward(weights, config, ids)
    torch.testing.assert_close(ours[0], hf[1], rtol=1e-4, atol=1e-4)  # the last one is after the final norm


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_awq_scale_folding_keeps_the_float_model(num_kv_heads):
    """Without clipping, AWQ's scaling is an equivalent transformation: the scaled weights
    (norms, v_proj / up_proj rows divided, projections' columns multiplied) compute the same."""
    config, _, weights = tiny_weights(num_kv_heads, seed=1)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(10))
    before = block_forward(weights, config, ids)
    scaled = dict(weights)
    hist = awq_model(scaled, config, ids, Grid(4, 16, sym=False), n_grid=10, clip=False, search_samples=2,
                     batch_size=3)
    groups = {k.rsplit(".", 1)[1] for k in hist}
    assert groups == ({"q_proj+k_proj+v_proj", "gate_proj+up_proj", "down_proj"}
                      | ({"o_proj"} if num_kv_heads == 4 else set()))
    changed = [n for n in weights if not torch.equal(weights[n], scaled[n])]
    assert "model.layers.0.input_layernorm.weight" in changed and "model.layers.1.mlp.up_proj.weight" in changed
    assert ("model.layers.1.self_attn.o_proj.weight" in changed) == (num_kv_heads == 4)  # folded into v_proj
    for a, b in zip(before, block_forward(scaled, config, ids)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_token_windows():
    ids = list(range(1000))
    w = token_windows(ids, 4, 100)
    assert w.shape == (4, 100) and w[0, 0] == 0 and w[-1, 0] == 900
    starts = w[:, 0].tolist()
    assert all(b - a >= 100 for a, b in zip(starts, starts[1:]))  # disjoint
    w = token_windows(ids, 30, 100)  # more than the text holds: evenly spaced, overlapping
    assert w.shape == (30, 100) and w[0, 0] == 0 and w[-1, -1] == 999
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 100)) for row in w)
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(ids[:50], 1, 100)


def test_shipped_texts_are_separate_and_large_enough():
    cal, held = shipped_text(CALIBRATION), shipped_text(HELDOUT)
    assert len(cal.encode()) > 250_000 and 50_000 < len(held.encode()) < 120_000
    cal_paragraphs = {p.strip() for p in cal.split("\n\n") if len(p.strip()) > 80}
    held_paragraphs = {p.strip() for p in held.split("\n\n") if len(p.strip()) > 80}
    assert len(held_paragraphs) > 100 and not cal_paragraphs & held_paragraphs
