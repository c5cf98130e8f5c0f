"""Prefill attention with bidirectional spans (Gemma 3's image blocks,
`AttentionMetadata.prefill_bidirectional_spans`) against transformers' own mask functions
(AND(sliding window, OR(causal, blockwise))), through the torch backend and the recompute the
Triton backend runs after its causal kernel; text-only steps keep the C kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.masking_utils import and_masks, blockwise_overlay, causal_mask_function, or_masks, sliding_window_overlay

from pagedllm.layers.backends import torch_paged
from pagedllm.layers.backends.paged_ops import prefill_mask
from pagedllm.layers.backends.torch_paged import TorchPagedAttentionBackend, redo_bidirectional_prefills
from tests.unit.test_prefill_attention_kernel import _case


def hf_visible(ctx: int, q_len: int, spans: list[tuple[int, int]], window: int | None) -> torch.Tensor:
    """transformers' mask for the last `q_len` queries of `ctx` positions with `spans` as image
    blocks (masking_utils' functions, as Gemma 3's `create_masks_for_vision_model` composes them)."""
    block = torch.full((1, ctx), -1, dtype=torch.long)
    for j, (a, b) in enumerate(spans):
        block[0, a:b] = j
    fn = or_masks(causal_mask_function, blockwise_overlay(block))
    if window is not None:
        fn = and_masks(fn, sliding_window_overlay(window))
    q = torch.arange(ctx - q_len, ctx)[:, None]
    k = torch.arange(ctx)[None, :]
    return fn(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, k)


@pytest.mark.parametrize("q_len,ctx,spans,window", [
    (30, 30, [(4, 20)], None),
    (30, 30, [(2, 8), (12, 28)], 5),  # two blocks, a window shorter than a block
    (12, 40, [(28, 36)], None),  # a chunk on cached context
    (12, 40, [(28, 34), (35, 38)], 4),
])
def test_mask_is_transformers_mask(q_len, ctx, spans, window):
    mask = prefill_mask(q_len, ctx, window, torch.float32, torch.device("cpu"), spans=spans)
    assert torch.equal(mask == 0, hf_visible(ctx, q_len, spans, window))
    plain = prefill_mask(q_len, ctx, window, torch.float32, torch.device("cpu"), explicit=True)
    assert not torch.equal(mask, plain)  # the spans open keys


def _reference(q, k, v, kc, vc, md, scale, window):
    """Float64 attention of every prefill over its gathered context with transformers' mask."""
    kc, vc = kc.clone(), vc.clone()
    hk, dh = kc.shape[2], kc.shape[3]
    nd = md.num_decode_tokens
    kc.view(-1, hk, dh)[md.slot_mapping[nd:]] = k[nd:]
    vc.view(-1, hk, dh)[md.slot_mapping[nd:]] = v[nd:]
    outs = []
    for i in range(md.num_prefills):
        start, q_len, ctx = md.prefill_query_starts[i], md.prefill_query_lens[i], md.prefill_context_lens[i]
        table = md.prefill_block_tables[i]
        keys = kc[table].reshape(-1, hk, dh)[:ctx].double()
        vals = vc[table].reshape(-1, hk, dh)[:ctx].double()
        qs = q[start:start + q_len].double()
        group = qs.shape[1] // hk
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        visible = hf_visible(ctx, q_len, md.prefill_bidirectional_spans[i], window)
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vals))
    return torch.cat(outs).float()


SEQS = [(23, 23), (8, 41), (19, 19)]
SPANS = [[(3, 19)], [(34, 40)], []]  # a prompt with an image, a chunk with one, a text prompt


@pytest.mark.parametrize("window", [None, 6])
def test_torch_backend_with_spans_matches_reference_and_skips_the_c_kernel(window, monkeypatch):
    q, k, v, kc, vc, md = _case(SEQS, 6, 2, 16, 8, num_decodes=2)
    md.prefill_bidirectional_spans = SPANS
    want = _reference(q, k, v, kc, vc, md, 0.25, window)

    def refuse(*args, **kwargs):
        raise AssertionError("the causal C kernel ran on a step with bidirectional spans")

    monkeypatch.setattr(torch_paged, "prefill_attention_c", refuse)
    got = TorchPagedAttentionBackend.forward(q, k, v, torch.stack([kc, vc]), md, 0.25, window)
    nd = md.num_decode_tokens
    torch.testing.assert_close(got[nd:], want, rtol=1e-5, atol=2e-6)


def test_text_only_steps_keep_the_c_kernel(monkeypatch):
    q, k, v, kc, vc, md = _case(SEQS, 6, 2, 16, 8)
    calls = []
    real = torch_paged.prefill_attention_c
    monkeypatch.setattr(torch_paged, "prefill_attention_c", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    TorchPagedAttentionBackend.forward(q, k, v, torch.stack([kc, vc]), md, 0.25, None)
    assert calls


def test_recompute_after_a_causal_kernel_gives_the_bidirectional_output():
    """The Triton backend's route: causal output for every sequence (its kernel), then the
    sequences with spans recomputed from the cache."""
    q, k, v, kc, vc, md = _case(SEQS, 6, 2, 16, 8)
    cache = torch.stack([kc, vc])
    causal = TorchPagedAttentionBackend.forward(q, k, v, cache, md, 0.25, 6)  # writes the K/V
    md = dataclasses.replace(md, _mask_cache={})
    md.prefill_bidirectional_spans = SPANS
    out = causal.clone()
    redo_bidirectional_prefills(q, k, v, cache, md, 0.25, 6, None, None, 0.0, out)
    torch.testing.assert_close(out, _reference(q, k, v, kc, vc, md, 0.25, 6), rtol=1e-5, atol=2e-6)
    third = slice(md.prefill_query_starts[2], None)
    assert torch.equal(out[third], causal[third])  # no spans: untouched
    assert not torch.allclose(out[:third.start], causal[:third.start])
