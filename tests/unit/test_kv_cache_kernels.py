"""The C attention kernels on bfloat16 and int8 caches against plain torch: reads (attention
over the dequantized blocks in float64), writes (the same bytes as the torch write path), and
the backend's C path against its portable path on one mixed step."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import kv_cache_dtype as F
from pagedllm.layers.backends import decode_op, prefill_op
from pagedllm.layers.backends.decode_op import decode_attention_c, decode_attention_torch
from pagedllm.layers.backends.prefill_op import prefill_attention_c
from pagedllm.layers.backends.torch_paged import TorchPagedAttentionBackend
from tests.unit.test_prefill_attention_kernel import CASES as PREFILL_CASES
from tests.unit.test_prefill_attention_kernel import _case as prefill_case
from tests.unit.test_prefill_attention_kernel import attend_prefills

DTYPES = [torch.bfloat16, torch.int8]
needs_kernels = pytest.mark.skipif(decode_op._c_kernel() is None or prefill_op._c_kernel() is None,
                                   reason="no C compiler: torch path only")


def _as_dtype(kc: torch.Tensor, vc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple]:
    """Float caches `[nb, B, Hk, D]` -> one layer cache of `dtype` holding them (int8: each
    block quantized in one write) and its (keys, values) halves."""
    nb, B, hk, d = kc.shape
    kv = torch.zeros(F.layer_shape(dtype, nb, B, hk, d), dtype=dtype)
    halves = F.split_kv_cache(kv, hk, d)
    slots = torch.arange(nb * B)
    for half, src in zip(halves, (kc, vc)):
        F.write_rows(half, src.reshape(-1, hk, d), slots)
    return kv, halves


def _decode_reference(q, keys, values, tables, ctx, scale, window):
    """float64 softmax attention over the dequantized blocks, one sequence at a time."""
    k_all, v_all = F.dequantize(keys).double(), F.dequantize(values).double()
    B, hk, d = k_all.shape[1:]
    out = []
    for s in range(q.shape[0]):
        n = int(ctx[s])
        k = k_all[tables[s]].reshape(-1, hk, d)[:n]
        v = v_all[tables[s]].reshape(-1, hk, d)[:n]
        lo = max(0, n - window) if window else 0
        k, v = k[lo:], v[lo:]
        group = q.shape[1] // hk
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        w = (torch.einsum("hd,khd->hk", q[s].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", w, v))
    return torch.stack(out).float()


DECODE_SHAPES = [
    (6, 9, 3, 64, 16, None),  # SmolLM2: the head_dim-64 fast path, three query heads per KV head
    (3, 4, 4, 32, 8, None),  # multi-head, the general loops (16-wide rows)
    (5, 8, 2, 64, 32, 20),  # sliding window
    (4, 6, 1, 24, 1, 7),  # block size 1, head_dim not a multiple of 16 (scalar loads)
    (3, 4, 2, 64, 128, None),  # blocks of 128 in 64-position chunks
    (9, 5, 1, 64, 32, None),  # five query heads per KV head: general loops at head_dim 64
]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "int8"])
@pytest.mark.parametrize("num_seqs,num_heads,num_kv_heads,head_dim,block_size,window", DECODE_SHAPES)
def test_decode_kernel_reads_blocks_in_place(dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, window):
    g = torch.Generator().manual_seed(3)
    nb, width = 40, 8
    _, (keys, values) = _as_dtype(torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g) * 2,
                                  torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g), dtype)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in range(num_seqs)])
    ctx = torch.randint(1, width * block_size + 1, (num_seqs,), generator=g)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    got = decode_attention_c(q, keys, values, tables, ctx, scale, window)
    assert got is not None
    want = _decode_reference(q, keys, values, tables, ctx, scale, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)
    torch.testing.assert_close(decode_attention_torch(q, keys, values, tables, ctx, scale, window), want,
                               rtol=1e-5, atol=3e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "int8"])
def test_decode_kernel_writes_like_torch(dtype):
    """Each sequence's new row lands in a partly filled block (int8: larger than what is there,
    so the block's scale grows and its tokens are requantized): the kernel's bytes equal the
    torch write path's, and the token attends to its own stored row."""
    g = torch.Generator().manual_seed(4)
    nb, B, hk, d, S = 24, 16, 3, 64, 5
    kv, (keys, values) = _as_dtype(torch.randn(nb, B, hk, d, generator=g), torch.randn(nb, B, hk, d, generator=g), dtype)
    tables = torch.stack([torch.randperm(nb, generator=g)[:3] for _ in range(S)])
    ctx = torch.tensor([5, 17, 33, 1, 48])  # offsets 4, 0, 0, 0, 15 of the last block
    last = ctx - 1
    slots = tables[torch.arange(S), last // B] * B + last % B
    qkv = torch.randn(S, (9 + 2 * hk) * d, generator=g) * 3
    q, k, v = (t.view(S, -1, d) for t in qkv.split([9 * d, hk * d, hk * d], dim=-1))  # strided views
    ref = kv.clone()
    ref_keys, ref_values = F.split_kv_cache(ref, hk, d)
    F.write_rows(ref_keys, k, slots)
    F.write_rows(ref_values, v, slots)
    out = decode_attention_c(q, keys, values, tables, ctx, d**-0.5, None, new_kv=(k, v, slots))
    assert torch.equal(kv, ref)
    torch.testing.assert_close(out, _decode_reference(q, ref_keys, ref_values, tables, ctx, d**-0.5, None),
                               rtol=1e-5, atol=3e-6)


@needs_kernels
def test_decode_op_on_int8_cache_through_the_registered_op():
    """The compiled decode graphs call `torch.ops.pagedllm.paged_decode_attention`: an int8 layer
    cache goes through it (mutated in place) as through the eager call."""
    g = torch.Generator().manual_seed(5)
    nb, B, hk, d, S = 12, 8, 2, 16, 3
    kv, _ = _as_dtype(torch.randn(nb, B, hk, d, generator=g), torch.randn(nb, B, hk, d, generator=g), torch.int8)
    tables = torch.stack([torch.randperm(nb, generator=g)[:2] for _ in range(S)])
    ctx = torch.tensor([3, 9, 16])
    last = ctx - 1
    slots = tables[torch.arange(S), last // B] * B + last % B
    q, k, v = torch.randn(S, 4, d, generator=g), torch.randn(S, hk, d, generator=g), torch.randn(S, hk, d, generator=g)
    eager_kv = kv.clone()
    want = decode_op.paged_decode_attention_eager(q, k, v, eager_kv, slots, tables, ctx, 0.25, None)
    got = torch.ops.pagedllm.paged_decode_attention(q, k, v, kv, slots, tables, ctx, 0.25, None)
    assert torch.equal(kv, eager_kv) and torch.equal(got, want)


def _prefill_reference(q, k, v, kv, md, scale, window):
    """Store the new rows with the torch write path, then float64 attention over the
    dequantized context (the queries see the cache's values, their own included)."""
    hk, d = k.shape[1:]
    ref = kv.clone()
    keys, values = F.split_kv_cache(ref, hk, d)
    nd = md.num_decode_tokens
    F.write_rows(keys, k[nd:], md.slot_mapping[nd:])
    F.write_rows(values, v[nd:], md.slot_mapping[nd:])
    kf, vf = F.dequantize(keys), F.dequantize(values)
    return attend_prefills(q, kf, vf, md, scale, window), ref


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "int8"])
@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,head_dim,block_size,window", PREFILL_CASES)
def test_prefill_kernel_reads_and_writes_blocks(dtype, seqs, num_heads, num_kv_heads, head_dim, block_size, window):
    """Chunks on top of cached context start mid-block (int8: requantization of the block's
    earlier tokens) and span several blocks (each block quantized once per write)."""
    q, k, v, kc, vc, md = prefill_case(seqs, num_heads, num_kv_heads, head_dim, block_size)
    kv, (keys, values) = _as_dtype(kc, vc, dtype)
    scale = head_dim**-0.5
    want, ref = _prefill_reference(q, k, v, kv, md, scale, window)
    got = prefill_attention_c(q, k, v, keys, values, md, scale, window)
    assert got is not None
    assert torch.equal(kv, ref)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "int8"])
def test_backend_c_path_equals_portable_path(dtype, monkeypatch):
    """One step of 3 decodes and 2 prefills through the attention backend, with the C kernels
    and with the portable torch path (kernels off): the same cache bytes, close outputs."""
    q, k, v, kc, vc, md = prefill_case([(20, 45), (9, 9)], 9, 3, 64, 16, num_decodes=3)
    kv_c, _ = _as_dtype(kc, vc, dtype)
    kv_t = kv_c.clone()
    out_c = TorchPagedAttentionBackend.forward(q, k, v, kv_c, md, 0.125)
    monkeypatch.setattr(decode_op, "_c_kernel", lambda: None)
    monkeypatch.setattr(prefill_op, "_c_kernel", lambda: None)
    md._mask_cache.clear()
    out_t = TorchPagedAttentionBackend.forward(q, k, v, kv_t, md, 0.125)
    assert torch.equal(kv_c, kv_t)
    torch.testing.assert_close(out_c, out_t, rtol=1e-5, atol=3e-6)
