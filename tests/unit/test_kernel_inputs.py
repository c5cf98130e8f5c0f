"""The native boundary, inputs: every C kernel is handed a bad block id or a bad shape and must
answer with a `ValueError` naming the offending value (never read out of bounds: no segfault,
no garbage). The checks sit right before each ctypes call (layers/backends/decode_op.py,
layers/linear.py, layers/norm.py, activation.py, rotary.py) and, for block ids, in the C loop
that reads them (kernels/paged_decode_attention.c)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import fused
from pagedllm.layers import linear as linear_mod
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.backends import decode_op
from pagedllm.layers.backends.decode_op import decode_attention_c
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import rotate_qkv
from tests.unit.test_block_gemm import gguf_blocks

needs_attention = pytest.mark.skipif(decode_op._c_kernel() is None, reason="no C compiler: torch path only")
needs_gemm = pytest.mark.skipif(linear_mod._kernel() is None, reason="no C compiler: F.linear only")
needs_fused = pytest.mark.skipif(fused._kernel() is None, reason="no C compiler: torch only")

NUM_BLOCKS, BLOCK, HK, HQ, D = 12, 8, 2, 4, 16


def _attention_case(num_seqs=3, width=4):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(NUM_BLOCKS, BLOCK, HK, D, generator=g)
    vc = torch.randn(NUM_BLOCKS, BLOCK, HK, D, generator=g)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in range(num_seqs)])
    ctx = torch.full((num_seqs,), width * BLOCK)
    q = torch.randn(num_seqs, HQ, D, generator=g)
    return q, kc, vc, tables, ctx


# ---- decode attention: block ids ---------------------------------------------------------------


@needs_attention
@pytest.mark.parametrize("bad", [NUM_BLOCKS, -1, 10**12])
def test_decode_attention_bad_block_id_is_a_value_error(bad):
    q, kc, vc, tables, ctx = _attention_case()
    tables[1, 2] = bad
    with pytest.raises(ValueError, match=rf"block id {bad}\b.*sequence 1.*\[0, {NUM_BLOCKS}\)"):
        decode_attention_c(q, kc, vc, tables, ctx, 0.25, None)


@needs_attention
def test_decode_attention_ignores_padding_past_the_context():
    """Entries past a sequence's used blocks are padding (-1 or anything): never read, no error."""
    q, kc, vc, tables, ctx = _attention_case()
    ctx[0] = BLOCK + 1  # uses 2 of 4 entries
    want = decode_attention_c(q, kc, vc, tables, ctx, 0.25, None)
    tables[0, 2:] = -1
    torch.testing.assert_close(decode_attention_c(q, kc, vc, tables, ctx, 0.25, None), want)


@needs_attention
def test_decode_attention_bad_slot_names_it():
    q, kc, vc, tables, ctx = _attention_case()
    key, value = torch.randn(3, HK, D), torch.randn(3, HK, D)
    slots = torch.tensor([0, NUM_BLOCKS * BLOCK, 5])
    with pytest.raises(ValueError, match=rf"slot {NUM_BLOCKS * BLOCK}\b.*\[0, {NUM_BLOCKS * BLOCK}\)"):
        decode_attention_c(q, kc, vc, tables, ctx, 0.25, None, new_kv=(key, value, slots))


# ---- decode attention: shapes ------------------------------------------------------------------


def _bad_attention_shapes():
    q, kc, vc, tables, ctx = _attention_case()
    key, value, slots = torch.randn(3, HK, D), torch.randn(3, HK, D), torch.tensor([0, 1, 2])
    yield "query_head_dim", (torch.randn(3, HQ, D + 1), kc, vc, tables, ctx, None), "head_dim"
    yield "query_heads", (torch.randn(3, HK + 1, D), kc, vc, tables, ctx, None), "heads"
    yield "value_cache", (q, kc, torch.randn(NUM_BLOCKS, BLOCK, 1, D), tables, ctx, None), "value_cache"
    yield "table_rows", (q, kc, vc, tables[:2], ctx, None), "block_tables"
    yield "context_lens", (q, kc, vc, tables, ctx[:2], None), "context_lens"
    yield "new_key", (q, kc, vc, tables, ctx, (key[:, :1], value, slots)), "key"
    yield "slots", (q, kc, vc, tables, ctx, (key, value, slots[:2])), "slot_mapping"
    yield "query_rank", (q.reshape(3, -1), kc, vc, tables, ctx, None), "query"


@needs_attention
@pytest.mark.parametrize("what,args,name", list(_bad_attention_shapes()), ids=[c[0] for c in _bad_attention_shapes()])
def test_decode_attention_bad_shape_is_a_value_error(what, args, name):
    q, kc, vc, tables, ctx, new_kv = args
    with pytest.raises(ValueError, match=name):
        decode_attention_c(q, kc, vc, tables, ctx, 0.25, None, new_kv=new_kv)


# ---- GEMMs ---------------------------------------------------------------------------------------


@needs_gemm
@pytest.mark.parametrize("form", ["packed", "block"])
@pytest.mark.parametrize("rows", [1, 20])
def test_linear_in_features_mismatch_is_a_value_error(form, rows):
    w = torch.randn(48, 64) if form == "packed" else gguf_blocks("q8_0", 48, 64)  # exact Q8S: block form
    prepared = linear_mod.prepare_weight(w)
    assert (prepared.blocks is not None) == (form == "block") or linear_mod._block_kernel() is None  # int_gemm.c
    with pytest.raises(ValueError, match=r"96 in-features.*takes 64"):
        linear_mod.linear(torch.randn(rows, 96), w)
    with pytest.raises(ValueError, match=r"32 in-features.*takes 64"):
        linear_mod.linear(torch.randn(rows, 32), w)


@needs_gemm
def test_linear_bias_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match=r"bias.*\(47,\).*48"):
        linear_mod.linear(torch.randn(2, 64), torch.randn(48, 64), torch.randn(47))


# ---- fused ops -----------------------------------------------------------------------------------


@needs_fused
def test_rms_norm_hidden_mismatch_is_a_value_error():
    norm = RMSNorm(64)
    with pytest.raises(ValueError, match=r"hidden.*48.*64"):
        norm(torch.randn(3, 48))


@needs_fused
def test_rms_norm_residual_mismatch_is_a_value_error():
    norm = RMSNorm(64)
    with pytest.raises(ValueError, match=r"residual.*\(2, 64\).*\(3, 64\)"):
        norm(torch.randn(3, 64), torch.randn(2, 64))


@needs_fused
def test_silu_and_mul_odd_width_is_a_value_error():
    with pytest.raises(ValueError, match="even.*63"):
        SiluAndMul()(torch.randn(2, 63))


@needs_fused
@pytest.mark.parametrize("bad", ["cos_rows", "sin_width", "qkv_width"])
def test_rotary_bad_shapes_are_value_errors(bad):
    tokens, hq, hk, d = 5, 4, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hk) * d)
    cos, sin = torch.randn(tokens, d), torch.randn(tokens, d)
    if bad == "cos_rows":
        cos, match = torch.randn(tokens - 1, d), "cos"
    elif bad == "sin_width":
        sin, match = torch.randn(tokens, d // 2), "sin"
    else:
        qkv, match = torch.randn(tokens, (hq + hk) * d), "qkv"
    with pytest.raises(ValueError, match=match):
        rotate_qkv(qkv, cos, sin, hq, hk, d)
