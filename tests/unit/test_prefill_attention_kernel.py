"""The C paged prefill-attention kernel against a plain torch reference (gather each sequence's
context, float64 softmax attention with a bottom-right causal mask), and the backend's use of it
against its portable per-sequence SDPA path."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.backends import prefill_op
from pagedllm.layers.backends.prefill_op import prefill_attention_c
from pagedllm.layers.backends.torch_paged import TorchPagedAttentionBackend

needs_kernel = pytest.mark.skipif(prefill_op._c_kernel() is None, reason="no C compiler: torch path only")


def _case(seqs, num_heads, num_kv_heads, head_dim, block_size, num_decodes=0, seed=0, num_blocks=64):
    """`seqs`: (query_len, context_len) per prefill sequence. Returns q/k/v for all T rows
    (decodes first), the caches (random garbage in the cached context) and the metadata."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, starts = [], [], []
    dec_tables, dec_slots, dec_ctx = [], [], []
    for _ in range(num_decodes):  # decodes of one token with 5 cached ones
        t = [perm.pop(), perm.pop()] if block_size < 6 else [perm.pop()]
        dec_tables.append(t + [0] * (4 - len(t)))
        dec_slots.append(t[5 // block_size] * block_size + 5 % block_size)
        dec_ctx.append(6)
    row = num_decodes
    for q_len, ctx in seqs:
        n = -(-ctx // block_size)
        t = [perm.pop() for _ in range(n)]
        tables.append(t)
        starts.append(row)
        row += q_len
        for p in range(ctx - q_len, ctx):
            slots.append(t[p // block_size] * block_size + p % block_size)
    T = row
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    qkv = torch.randn(T, num_heads + 2 * num_kv_heads, head_dim, generator=g)  # fused projection
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(dec_slots + slots, dtype=torch.long),
        block_size=block_size,
        num_decode_tokens=num_decodes,
        decode_block_tables=torch.tensor(dec_tables, dtype=torch.long) if num_decodes else None,
        decode_context_lens=torch.tensor(dec_ctx, dtype=torch.long) if num_decodes else None,
        prefill_query_starts=starts,
        prefill_query_lens=[s[0] for s in seqs],
        prefill_context_lens=[s[1] for s in seqs],
        prefill_block_tables=[torch.tensor(t, dtype=torch.long) for t in tables],
        prefill_block_tables_padded=padded,
    )
    return q, k, v, kc, vc, md


def attend_prefills(q, keys, vals, md, scale, window, softcap=None):
    """Float64 causal attention of each prefill's queries over its gathered context: `keys` and
    `vals` are the cache's blocks `[num_blocks, block, Hk, dh]` (any float dtype); `softcap`:
    the scaled scores become `softcap * tanh(s / softcap)` before the mask."""
    hk, dh = keys.shape[-2:]
    outs = []
    for i in range(md.num_prefills):
        start, q_len, ctx = md.prefill_query_starts[i], md.prefill_query_lens[i], md.prefill_context_lens[i]
        table = md.prefill_block_tables[i]
        keys_i = keys[table].reshape(-1, hk, dh)[:ctx].double()  # [ctx, Hk, dh]
        vals_i = vals[table].reshape(-1, hk, dh)[:ctx].double()
        qs = q[start : start + q_len].double()  # [q, Hq, dh]
        group = qs.shape[1] // hk
        keys_i, vals_i = keys_i.repeat_interleave(group, 1), vals_i.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, keys_i) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(ctx - q_len, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals_i).float())
    return torch.cat(outs)


def _reference(q, k, v, kc, vc, md, scale, window, softcap=None):
    """Plain torch, float64: store the new K/V, gather each context, (soft-cap,) mask, softmax."""
    kc, vc = kc.clone(), vc.clone()
    nd = md.num_decode_tokens
    hk, dh = kc.shape[2], kc.shape[3]
    kc.view(-1, hk, dh)[md.slot_mapping[nd:]] = k[nd:]
    vc.view(-1, hk, dh)[md.slot_mapping[nd:]] = v[nd:]
    return attend_prefills(q, kc, vc, md, scale, window, softcap), kc, vc


CASES = [
    # (prefill (query_len, context_len) list, heads, kv heads, head_dim, block size, window)
    ([(37, 37), (5, 60), (16, 16)], 9, 3, 64, 16, None),  # SmolLM2: prompts and a chunk on a cache
    ([(1, 1), (2, 2), (70, 130)], 4, 4, 32, 8, None),  # tiny prompts, multi-head, long chunk
    ([(40, 90), (33, 33)], 8, 2, 64, 32, 20),  # sliding window shorter than the contexts
    ([(9, 20), (3, 3)], 6, 1, 24, 1, 7),  # block size 1, multi-query, head_dim not a multiple of 16
    ([(17, 17)], 2, 1, 8, 64, None),  # block larger than the key chunk
]


@needs_kernel
@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,head_dim,block_size,window", CASES)
def test_c_kernel_matches_reference_and_writes_the_cache(seqs, num_heads, num_kv_heads, head_dim, block_size, window):
    q, k, v, kc, vc, md = _case(seqs, num_heads, num_kv_heads, head_dim, block_size)
    want, want_kc, want_vc = _reference(q, k, v, kc, vc, md, head_dim**-0.5, window)
    got = prefill_attention_c(q, k, v, kc, vc, md, head_dim**-0.5, window)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


@needs_kernel
@pytest.mark.parametrize("window", [None, 11])
def test_backend_kernel_equals_its_portable_path_with_decodes_in_the_batch(window):
    seqs = [(23, 23), (8, 41), (1, 19)]
    q, k, v, kc, vc, md = _case(seqs, 9, 3, 64, 16, num_decodes=3)
    cache = torch.stack([kc, vc])
    got = TorchPagedAttentionBackend.forward(q, k, v, cache.clone(), md, 0.125, window)
    md_portable = AttentionMetadata(**{**md.__dict__, "prefill_block_tables_padded": None, "_mask_cache": {}})
    want_cache = cache.clone()
    want = TorchPagedAttentionBackend.forward(q, k, v, want_cache, md_portable, 0.125, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("bad", [64, -1, 10**12])
def test_bad_block_id_is_a_value_error_naming_it(bad):
    q, k, v, kc, vc, md = _case([(5, 20), (4, 4)], 4, 2, 16, 8)
    md.prefill_block_tables_padded[0, 1] = bad
    before = kc.clone()
    with pytest.raises(ValueError, match=rf"block id {bad}\b.*sequence 0.*\[0, 64\)"):
        prefill_attention_c(q, k, v, kc, vc, md, 0.25, None)
    assert torch.equal(kc, before)  # refused before anything was written


@needs_kernel
def test_padding_past_the_context_is_never_read():
    q, k, v, kc, vc, md = _case([(5, 9), (4, 30)], 4, 2, 16, 8)
    want = prefill_attention_c(q, k, v, kc.clone(), vc.clone(), md, 0.25, None)
    md.prefill_block_tables_padded[0, 2:] = -1  # sequence 0 uses 2 of 4 entries
    got = prefill_attention_c(q, k, v, kc.clone(), vc.clone(), md, 0.25, None)
    torch.testing.assert_close(got, want)


@needs_kernel
def test_bad_slot_and_lengths_are_value_errors():
    q, k, v, kc, vc, md = _case([(5, 20)], 4, 2, 16, 8)
    md.slot_mapping[2] = 64 * 8
    with pytest.raises(ValueError, match=r"slot 512 is outside"):
        prefill_attention_c(q, k, v, kc, vc, md, 0.25, None)
    q, k, v, kc, vc, md = _case([(5, 20)], 4, 2, 16, 8)
    md.prefill_context_lens[0] = 4  # fewer than its query rows
    with pytest.raises(ValueError, match=r"sequence 0 has query rows 0..5"):
        prefill_attention_c(q, k, v, kc, vc, md, 0.25, None)
    q, k, v, kc, vc, md = _case([(5, 20)], 4, 2, 16, 8)
    md.prefill_context_lens[0] = 40  # needs 5 blocks, the table has 3
    with pytest.raises(ValueError, match=r"context length 40 of sequence 0 exceeds its block table"):
        prefill_attention_c(q, k, v, kc, vc, md, 0.25, None)


def test_declines_other_dtypes_and_missing_tables():
    q, k, v, kc, vc, md = _case([(5, 9)], 4, 2, 16, 8)
    assert prefill_attention_c(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc.bfloat16(), vc.bfloat16(), md, 0.25, None) is None
    md.prefill_block_tables_padded = None
    assert prefill_attention_c(q, k, v, kc, vc, md, 0.25, None) is None


# ---- logit soft-capping (Gemma 2's attn_logit_softcapping) ----------------------------------------

@needs_kernel
@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,head_dim,block_size,window", CASES)
@pytest.mark.parametrize("cap", [2.0, 50.0])
def test_softcap_c_kernel_matches_reference(seqs, num_heads, num_kv_heads, head_dim, block_size, window, cap):
    q, k, v, kc, vc, md = _case(seqs, num_heads, num_kv_heads, head_dim, block_size)
    q = q * 2.0  # scores of a few units: a cap of 2 bends most of them
    scale = head_dim**-0.5
    want, want_kc, want_vc = _reference(q, k, v, kc, vc, md, scale, window, cap)
    got = prefill_attention_c(q, k, v, kc, vc, md, scale, window, logits_soft_cap=cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    if cap < 10:  # the cap changes the result (the comparison above is not vacuous)
        assert float((_reference(q, k, v, kc, vc, md, scale, window)[0] - want).abs().max()) > 1e-2


@pytest.mark.parametrize("window", [None, 11])
def test_softcap_backend_portable_path_matches_reference_with_decodes(window):
    """The torch backend without the C kernels (SDPA cannot cap: explicit matmuls), prompts and
    chunks on cached context next to decodes, equals the plain reference; so does its kernel path."""
    seqs = [(23, 23), (8, 41), (1, 19)]
    q, k, v, kc, vc, md = _case(seqs, 9, 3, 64, 16, num_decodes=3)
    q = q * 2.0
    want, _, _ = _reference(q, k, v, kc, vc, md, 0.125, window, 2.0)
    md_portable = AttentionMetadata(**{**md.__dict__, "prefill_block_tables_padded": None, "_mask_cache": {}})
    got = TorchPagedAttentionBackend.forward(q, k, v, torch.stack([kc, vc]), md_portable, 0.125, window,
                                             logits_soft_cap=2.0)
    nd = md.num_decode_tokens
    torch.testing.assert_close(got[nd:], want, rtol=1e-5, atol=3e-6)
    if prefill_op._c_kernel() is not None:
        fast = TorchPagedAttentionBackend.forward(q, k, v, torch.stack([kc, vc]), md, 0.125, window,
                                                  logits_soft_cap=2.0)
        torch.testing.assert_close(fast, got, rtol=1e-5, atol=3e-6)
