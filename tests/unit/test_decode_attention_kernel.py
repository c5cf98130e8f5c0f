"""The C paged decode-attention kernel against the portable torch path, and the op around both."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import build as kernel_build
from pagedllm.layers.backends import decode_op
from pagedllm.layers.backends.decode_op import decode_attention_c, decode_attention_torch


def _case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, seed=0, num_blocks=48, width=10):
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(num_seqs)])
    ctx = torch.randint(1, width * block_size + 1, (num_seqs,), generator=g)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    return query, key_cache, value_cache, tables, ctx


needs_kernel = pytest.mark.skipif(decode_op._c_kernel() is None, reason="no C compiler: torch path only")


@needs_kernel
@pytest.mark.parametrize(
    "num_seqs,num_heads,num_kv_heads,head_dim,block_size,window",
    [
        (6, 9, 3, 64, 16, None),  # SmolLM2's grouped-query shape
        (3, 4, 4, 32, 8, None),  # multi-head
        (5, 8, 2, 64, 32, 20),  # sliding window shorter than most contexts
        (1, 9, 3, 64, 16, None),  # single sequence
        (4, 6, 1, 16, 1, 7),  # block size 1, multi-query
        # head_dim 64 takes the kernel's fast path (16 scores at a time, register accumulators):
        (7, 2, 2, 64, 8, None),  # one query head per KV head
        (3, 4, 2, 64, 128, None),  # two per KV head; blocks of 128 in 64-position chunks
        (2, 12, 3, 64, 16, 5),  # four per KV head, a window shorter than a block
        (9, 5, 1, 64, 32, None),  # five per KV head: the general loops
    ],
)
def test_c_kernel_matches_torch(num_seqs, num_heads, num_kv_heads, head_dim, block_size, window):
    q, kc, vc, tables, ctx = _case(num_seqs, num_heads, num_kv_heads, head_dim, block_size)
    got = decode_attention_c(q, kc, vc, tables, ctx, head_dim**-0.5, window)
    want = decode_attention_torch(q, kc, vc, tables, ctx, head_dim**-0.5, window)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_c_kernel_context_past_table_is_an_error():
    q, kc, vc, tables, ctx = _case(2, 4, 2, 16, 8, width=2)
    ctx[1] = 3 * 8  # needs 3 blocks, the table has 2
    with pytest.raises(ValueError, match="exceeds its block table"):
        decode_attention_c(q, kc, vc, tables, ctx, 0.25, None)


def test_c_kernel_declines_other_dtypes():
    q, kc, vc, tables, ctx = _case(2, 4, 2, 16, 8)
    args = (q.bfloat16(), kc.bfloat16(), vc.bfloat16(), tables, ctx, 0.25, None)
    assert decode_attention_c(*args) is None


def test_op_writes_kv_then_attends_over_it():
    """The op stores the new token's K/V at its slot first, so the token attends to itself."""
    q, kc, vc, tables, ctx = _case(3, 4, 2, 16, 8)
    key = torch.randn(3, 2, 16)
    value = torch.randn(3, 2, 16)
    last = ctx - 1
    slots = tables[torch.arange(3), last // 8] * 8 + last % 8
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_cache = torch.stack([kc, vc])
    out = torch.ops.pagedllm.paged_decode_attention(q, key, value, kv_cache, slots, tables, ctx, 0.25, None)
    kc, vc = kv_cache[0], kv_cache[1]
    kc_ref.view(-1, 2, 16)[slots] = key
    vc_ref.view(-1, 2, 16)[slots] = value
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    torch.testing.assert_close(out, decode_attention_torch(q, kc_ref, vc_ref, tables, ctx, 0.25, None))


def test_disabled_kernels_build_nothing(monkeypatch):
    monkeypatch.setenv(kernel_build.DISABLE_ENV, "1")
    assert kernel_build._build("paged_decode_attention.c") is None


def test_missing_compiler_falls_back(monkeypatch, tmp_path):
    # the build marks a compiler that cannot run as broken for the process: restored after
    monkeypatch.setattr(kernel_build, "_broken_compiler", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    assert kernel_build._build("paged_decode_attention.c") is None


@needs_kernel
def test_c_kernel_writes_strided_rows_and_rejects_bad_slots():
    """K/V/query as views into one fused projection (rows apart), written by the kernel itself."""
    q, kc, vc, tables, ctx = _case(4, 6, 2, 16, 8)
    qkv = torch.randn(4, (6 + 2 + 2) * 16)
    query, key, value = (t.view(4, -1, 16) for t in qkv.split([96, 32, 32], dim=-1))
    last = ctx - 1
    slots = tables[torch.arange(4), last // 8] * 8 + last % 8
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref.view(-1, 2, 16)[slots] = key
    vc_ref.view(-1, 2, 16)[slots] = value
    out = decode_attention_c(query, kc, vc, tables, ctx, 0.25, None, new_kv=(key, value, slots))
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    torch.testing.assert_close(out, decode_attention_torch(query.contiguous(), kc_ref, vc_ref, tables, ctx, 0.25, None))
    slots[0] = kc.shape[0] * 8  # one past the last slot
    with pytest.raises(ValueError, match="outside the KV cache"):
        decode_attention_c(query, kc, vc, tables, ctx, 0.25, None, new_kv=(key, value, slots))


# ---- logit soft-capping (Gemma 2's attn_logit_softcapping) ----------------------------------------

def _softcap_reference(query, key_cache, value_cache, tables, ctx, scale, window, cap):
    """float64, per sequence: scores * scale, `cap * tanh(s / cap)`, window, softmax, values."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for s in range(num_seqs):
        c = int(ctx[s])
        blocks = tables[s, : -(-c // block_size)]
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:c].double().repeat_interleave(group, 1)
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:c].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[s].double(), k) * scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        if window:
            scores[:, : max(0, c - window)] = float("-inf")
        out[s] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


SOFTCAP_CASES = [
    # (seqs, heads, kv heads, head_dim, block size, window, cap)
    (6, 9, 3, 64, 16, None, 2.0),  # head_dim 64: the kernel's fast path
    (5, 8, 2, 64, 32, 20, 1.5),  # with a sliding window
    (4, 6, 1, 16, 8, None, 3.0),  # the general loops, multi-query
    (3, 4, 4, 32, 8, 7, 50.0),  # Gemma 2's cap: hardly capped at these scores, still equal
]


@needs_kernel
@pytest.mark.parametrize("num_seqs,num_heads,num_kv_heads,head_dim,block_size,window,cap", SOFTCAP_CASES)
def test_softcap_c_kernel_and_torch_path_match_a_plain_reference(num_seqs, num_heads, num_kv_heads, head_dim,
                                                                 block_size, window, cap):
    q, kc, vc, tables, ctx = _case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, seed=3)
    q = q * 2.0  # scores of a few units: a cap of 1.5-3 bends most of them
    scale = head_dim**-0.5
    want = _softcap_reference(q, kc, vc, tables, ctx, scale, window, cap).float()
    got = decode_attention_c(q, kc, vc, tables, ctx, scale, window, logits_soft_cap=cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
    torch.testing.assert_close(decode_attention_torch(q, kc, vc, tables, ctx, scale, window, cap), want,
                               rtol=1e-5, atol=3e-6)
    if cap < 10:  # the cap changes the result (the comparison above is not vacuous)
        plain = decode_attention_c(q, kc, vc, tables, ctx, scale, window)
        assert float((plain - want).abs().max()) > 1e-2


def test_softcap_torch_path_in_bfloat16_and_through_the_op():
    """bfloat16 (the C kernel declines it): the torch path's explicit matmuls; and the registered
    op with its cap argument, the path compiled decode graphs take."""
    q, kc, vc, tables, ctx = _case(3, 4, 2, 16, 8, seed=4)
    q = q * 3.0
    want = _softcap_reference(q, kc, vc, tables, ctx, 0.25, None, 2.0)
    got = decode_attention_torch(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), tables, ctx, 0.25, None, 2.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-2)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    last = ctx - 1
    slots = tables[torch.arange(3), last // 8] * 8 + last % 8
    kv_cache = torch.stack([kc, vc])
    out = torch.ops.pagedllm.paged_decode_attention(q, key, value, kv_cache, slots, tables, ctx, 0.25, None,
                                                    None, None, 2.0)
    want = _softcap_reference(q, kv_cache[0], kv_cache[1], tables, ctx, 0.25, None, 2.0).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan"), True, "5"])
def test_attention_layer_refuses_a_bad_soft_cap(cap):
    from pagedllm.layers.attention import Attention

    with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number"):
        Attention(4, 16, 0.25, 2, logits_soft_cap=cap)
