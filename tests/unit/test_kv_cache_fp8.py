"""The fp8 KV cache (kv_cache_dtype "fp8" = "fp8_e4m3", "fp8_e5m2") on the torch path, without a
model: the names and sizes, the write / read round trip with per-KV-head scales against an
independent round-to-nearest-even reference, clamping, e4m3 against e5m2, decode and prefill
through the backend against float64 attention over the dequantized cache, the C kernels
declining fp8, the registered op (eager and compiled) taking the scales, block copies and swaps,
and the Attention layer's scale buffers."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers import kv_cache_dtype as F
from pagedllm.layers.attention import Attention, AttentionMetadata
from pagedllm.layers.backends import decode_op, prefill_op
from pagedllm.layers.backends.decode_op import decode_attention_c, decode_attention_torch
from pagedllm.layers.backends.prefill_op import prefill_attention_c
from pagedllm.layers.backends.torch_paged import TorchPagedAttentionBackend
from pagedllm.worker.cache_engine import CacheEngine
from tests.unit.test_kv_cache_kernels import _decode_reference
from tests.unit.test_prefill_attention_kernel import _case as prefill_case
from tests.unit.test_prefill_attention_kernel import attend_prefills

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
IDS = ["e4m3", "e5m2"]
needs_kernels = pytest.mark.skipif(decode_op._c_kernel() is None or prefill_op._c_kernel() is None,
                                   reason="no C compiler: nothing to decline")


def _fp8_cache(kc: torch.Tensor, vc: torch.Tensor, dtype: torch.dtype, k_scale, v_scale):
    """Float blocks `[nb, B, Hk, D]` -> one fp8 layer cache holding them and its halves."""
    nb, B, hk, d = kc.shape
    kv = torch.zeros(F.layer_shape(dtype, nb, B, hk, d), dtype=dtype)
    halves = F.split_kv_cache(kv, hk, d, k_scale, v_scale)
    for half, src in zip(halves, (kc, vc)):
        F.write_rows(half, src.reshape(-1, hk, d), torch.arange(nb * B))
    return kv, halves


def _nearest_fp8(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 `y` (already in range) to the nearest finite value of `dtype`, ties to the
    even code, by search over the format's whole value table: a reference that does not use
    torch's float -> fp8 conversion."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    values = codes.float()
    keep = torch.isfinite(values) & ~((values == 0) & (torch.arange(256) >= 128))  # no -0 duplicate
    values, bits = values[keep], torch.arange(256)[keep]
    order = values.argsort()
    values, bits = values[order], bits[order]
    flat = y.reshape(-1)
    hi = torch.searchsorted(values, flat).clamp(1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = (flat - values[lo]).abs(), (values[hi] - flat).abs()
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (bits[hi] % 2 == 0))
    return torch.where(pick_hi, values[hi], values[lo]).view(y.shape)


# ---- names, layout, sizes -----------------------------------------------------------------

def test_kv_cache_dtype_names():
    assert F.resolve_kv_cache_dtype("fp8", torch.float32) == E4M3  # vLLM's "fp8" is e4m3
    assert F.resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == E4M3
    assert F.resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == E5M2
    assert F.resolve_kv_cache_dtype("float16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        F.resolve_kv_cache_dtype("fp8_e4m3fnuz", torch.float32)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_fp8_layout_and_bytes_per_block(dtype):
    """The float layout at one byte an element: a quarter of float32, no header (the scales are
    the layer's, not the block's). SmolLM2: 30 layers, 3 KV heads of 64, blocks of 16."""
    assert F.layer_shape(dtype, 5, 16, 3, 64) == (2, 5, 16, 3, 64)
    assert CacheEngine.bytes_per_block(30, 3, 64, 16, dtype) == 2 * 30 * 16 * 3 * 64 == 184320
    assert CacheEngine.bytes_per_block(30, 3, 64, 16, torch.float32) == 4 * 184320
    assert CacheEngine.bytes_per_block(30, 3, 64, 16, torch.float16) == 2 * 184320
    eng = CacheEngine(2, 3, 64, 5, 16, dtype, "cpu")
    assert eng.kv_caches[0].dtype == dtype and eng.total_bytes == 5 * CacheEngine.bytes_per_block(2, 3, 64, 16, dtype)
    assert not eng.kv_caches[0].float().any()


def test_fp8_cache_without_scales_is_a_value_error():
    kv = torch.zeros(2, 3, 4, 2, 8, dtype=E4M3)
    with pytest.raises(ValueError, match=r"fp8 KV cache .* needs the layer's k_scale"):
        F.split_kv_cache(kv, 2, 8)
    with pytest.raises(ValueError, match=r"needs the layer's v_scale"):
        F.split_kv_cache(kv, 2, 8, torch.ones(2))
    with pytest.raises(ValueError, match=r"k_scale of an fp8 KV cache must have shape \[2\].*\(3,\)"):
        F.split_kv_cache(kv, 2, 8, torch.ones(3), torch.ones(2))
    keys, values = F.split_kv_cache(torch.zeros(2, 3, 4, 2, 8), 2, 8, torch.ones(5), None)  # ignored
    assert isinstance(keys, torch.Tensor)


# ---- write and read -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_round_trip_with_per_head_scales_equals_reference(dtype):
    """Rows written at scattered slots with a different scale per KV head (two orders of
    magnitude apart) read back as nearest-even(x / scale) * scale, exactly; the slots not
    written stay zero."""
    g = torch.Generator().manual_seed(0)
    nb, B, hk, d = 6, 4, 3, 16
    scale = torch.tensor([0.01, 0.5, 3.0])
    x = torch.randn(10, hk, d, generator=g) * scale[None, :, None] * 40  # the heads' ranges differ too
    slots = torch.randperm(nb * B, generator=g)[:10]
    kv = torch.zeros(F.layer_shape(dtype, nb, B, hk, d), dtype=dtype)
    keys, values = F.split_kv_cache(kv, hk, d, scale, torch.ones(hk))
    F.write_rows(keys, x, slots)
    want = _nearest_fp8(x / scale[None, :, None], dtype) * scale[None, :, None]
    got = F.dequantize(keys).view(-1, hk, d)
    assert torch.equal(got[slots], want)
    unwritten = torch.ones(nb * B, dtype=torch.bool)
    unwritten[slots] = False
    assert not got[unwritten].any() and not F.dequantize(values).any()
    table = torch.tensor([[slots[0] // B, slots[3] // B]])
    gathered = F.gather_blocks(keys, table)  # [1, 2 * B, Hk, D], float32
    assert gathered.dtype == torch.float32
    torch.testing.assert_close(gathered[0], torch.cat([got.view(nb, B, hk, d)[i] for i in table[0]]), rtol=0, atol=0)
    assert F.gather_blocks(keys, table, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_values_beyond_the_range_saturate(dtype):
    """|x| / scale above fmax (448 e4m3, 57344 e5m2) is stored as +-fmax, never inf or NaN
    (a plain e5m2 cast of 1e6 is -inf: the control)."""
    fmax = torch.finfo(dtype).max
    scale = torch.tensor([2.0])
    x = torch.tensor([[[1e6, -1e6, fmax * 2.0, -fmax * 2.1, 1.0, float("inf"), -float("inf"), 0.0]]])
    kv = torch.zeros(2, 1, 1, 1, 8, dtype=dtype)
    keys, _ = F.split_kv_cache(kv, 1, 8, scale, scale)
    F.write_rows(keys, x, torch.tensor([0]))
    got = F.dequantize(keys)[0, 0, 0]
    assert got.tolist() == [fmax * 2, -fmax * 2, fmax * 2, -fmax * 2, 1.0, fmax * 2, -fmax * 2, 0.0]
    if dtype == E5M2:
        assert torch.isinf(torch.tensor(-1e6).to(dtype).float())


def test_e4m3_is_finer_and_e5m2_wider():
    """e4m3: 3 mantissa bits (relative error <= 2^-4 on normals), range 448; e5m2: 2 bits
    (<= 2^-3), range 57344: at scale 1 a value of 20000 survives only in e5m2, and values of
    about 1 are twice as close in e4m3."""
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(4096, 1, 1, generator=g) * 2 + 0.5) * torch.where(torch.rand(4096, 1, 1, generator=g) < 0.5, -1, 1)
    err = {}
    for dtype in FP8:
        kv = torch.zeros(2, 4096, 1, 1, 1, dtype=dtype)
        keys, _ = F.split_kv_cache(kv, 1, 1, torch.ones(1), torch.ones(1))
        F.write_rows(keys, x, torch.arange(4096))
        rel = ((F.dequantize(keys).view(-1) - x.view(-1)) / x.view(-1)).abs()
        err[dtype] = rel
        assert rel.max() <= {E4M3: 2.0**-4, E5M2: 2.0**-3}[dtype]
        F.write_rows(keys, torch.full((1, 1, 1), 20000.0), torch.tensor([0]))
        assert F.dequantize(keys)[0].item() == {E4M3: 448.0, E5M2: 20480.0}[dtype]
    assert 1.7 < err[E5M2].mean() / err[E4M3].mean() < 2.3
    assert 0.02 < err[E4M3].mean() < 0.027  # measured 0.0233: a quarter ulp / the value, on average


# ---- attention through the backend --------------------------------------------------------

def _scales(hk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # |x| <= ~1.5 below: x / scale stays inside e4m3's 448, nothing saturates.
    return torch.rand(hk, generator=g) * 0.01 + 0.005, torch.rand(hk, generator=g) * 0.01 + 0.005


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("window", [None, 9])
def test_decode_through_the_backend_equals_attention_over_the_dequantized_cache(dtype, window):
    """Decode rows land in partly filled blocks (the op writes them, scaled), then attend over
    their context: the same as float64 attention over the dequantized cache, the new rows
    included; the cache's bytes equal the plain write path's."""
    g = torch.Generator().manual_seed(2)
    nb, B, hk, hq, d, S = 24, 8, 2, 6, 32, 4
    ks, vs = _scales(hk, 3)
    kc, vc = torch.randn(nb, B, hk, d, generator=g) * 0.3, torch.randn(nb, B, hk, d, generator=g) * 0.3
    kv, _ = _fp8_cache(kc, vc, dtype, ks, vs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:4] for _ in range(S)])
    ctx = torch.tensor([3, 8, 17, 30])
    last = ctx - 1
    slots = tables[torch.arange(S), last // B] * B + last % B
    q, k, v = (torch.randn(S, h, d, generator=g) * s for h, s in ((hq, 1.0), (hk, 0.3), (hk, 0.3)))
    md = AttentionMetadata(slot_mapping=slots, block_size=B, num_decode_tokens=S, decode_block_tables=tables,
                           decode_context_lens=ctx)
    ref = kv.clone()
    ref_k, ref_v = F.split_kv_cache(ref, hk, d, ks, vs)
    F.write_rows(ref_k, k, slots)
    F.write_rows(ref_v, v, slots)
    out = TorchPagedAttentionBackend.forward(q, k, v, kv, md, d**-0.5, window, k_scale=ks, v_scale=vs)
    assert torch.equal(kv.view(torch.uint8), ref.view(torch.uint8))
    want = _decode_reference(q, ref_k, ref_v, tables, ctx, d**-0.5, window)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=3e-6)
    # The stored values really are fp8: attention over the exact float K/V differs, by fp8's
    # rounding (a few percent of a value) and no more.
    for cache, new in ((kc, k), (vc, v)):
        cache.view(-1, hk, d)[slots] = new
    exact = _decode_reference(q, kc, vc, tables, ctx, d**-0.5, window)
    diff = (out - exact).abs().max().item()
    assert 1e-3 < diff < {E4M3: 0.04, E5M2: 0.07}[dtype], diff  # measured 0.022, 0.039


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_prefill_and_decode_step_through_the_backend(dtype):
    """One step of 3 decodes and 3 prefills (a prompt, a chunk on top of cached context that
    starts mid-block, one token): the C kernels decline fp8, the torch path runs and equals
    float64 attention over the dequantized cache, every query seeing the cache's values."""
    q, k, v, kc, vc, md = prefill_case([(20, 45), (9, 9), (1, 13)], 9, 3, 64, 16, num_decodes=3)
    ks, vs = _scales(3, 4)
    k, v = k * 0.3, v * 0.3
    kv, _ = _fp8_cache(kc * 0.3, vc * 0.3, dtype, ks, vs)
    ref = kv.clone()
    ref_k, ref_v = F.split_kv_cache(ref, 3, 64, ks, vs)
    F.write_rows(ref_k, k, md.slot_mapping)
    F.write_rows(ref_v, v, md.slot_mapping)
    out = TorchPagedAttentionBackend.forward(q, k, v, kv, md, 0.125, None, k_scale=ks, v_scale=vs)
    assert torch.equal(kv.view(torch.uint8), ref.view(torch.uint8))
    nd = md.num_decode_tokens
    want_dec = _decode_reference(q[:nd], ref_k, ref_v, md.decode_block_tables, md.decode_context_lens, 0.125, None)
    want_pre = attend_prefills(q, F.dequantize(ref_k), F.dequantize(ref_v), md, 0.125, None)
    torch.testing.assert_close(out[:nd], want_dec, rtol=1e-5, atol=3e-6)
    torch.testing.assert_close(out[nd:], want_pre, rtol=1e-5, atol=3e-6)
    with pytest.raises(ValueError, match="needs the layer's k_scale"):
        TorchPagedAttentionBackend.forward(q, k, v, kv, md, 0.125)


@needs_kernels
@pytest.mark.parametrize("dtype", [*FP8, torch.float16], ids=[*IDS, "f16"])
def test_c_kernels_decline_fp8_and_float16(dtype):
    """No element kind for them in kernels/kv_cache_types.h: both kernels return None before
    touching the cache (the torch path then writes and reads it)."""
    q, k, v, kc, vc, md = prefill_case([(5, 12)], 4, 2, 16, 8)
    kv = torch.stack([kc, vc]).to(dtype)
    before = kv.clone()
    ones = torch.ones(2)
    keys, values = F.split_kv_cache(kv, 2, 16, ones, ones)
    assert prefill_attention_c(q, k, v, keys, values, md, 0.25, None) is None
    tables, ctx = md.prefill_block_tables_padded, torch.tensor([12])
    assert decode_attention_c(q[:1], keys, values, tables, ctx, 0.25, None,
                              new_kv=(k[:1], v[:1], md.slot_mapping[:1])) is None
    assert torch.equal(kv.view(torch.uint8), before.view(torch.uint8))
    assert decode_attention_torch(q[:1], keys, values, tables, ctx, 0.25, None).shape == (1, 4, 16)


def _op_case(dtype):
    g = torch.Generator().manual_seed(5)
    nb, B, hk, d, S = 12, 8, 2, 16, 3
    ks, vs = torch.tensor([0.5, 0.02]), torch.tensor([0.01, 0.25])
    kv, _ = _fp8_cache(torch.randn(nb, B, hk, d, generator=g), torch.randn(nb, B, hk, d, generator=g) * 0.1,
                       dtype, ks, vs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:2] for _ in range(S)])
    ctx = torch.tensor([3, 9, 16])
    last = ctx - 1
    slots = tables[torch.arange(S), last // B] * B + last % B
    q, k, v = torch.randn(S, 4, d, generator=g), torch.randn(S, hk, d, generator=g), torch.randn(S, hk, d, generator=g)
    return q, k, v, kv, slots, tables, ctx, ks, vs


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_registered_op_takes_the_scales(dtype):
    """`torch.ops.pagedllm.paged_decode_attention` (what compiled decode graphs call) has
    optional `k_scale` / `v_scale` tensors: with them it equals the eager call byte for byte;
    an fp8 cache without them is the precise ValueError."""
    q, k, v, kv, slots, tables, ctx, ks, vs = _op_case(dtype)
    eager_kv = kv.clone()
    want = decode_op.paged_decode_attention_eager(q, k, v, eager_kv, slots, tables, ctx, 0.25, None, ks, vs)
    got = torch.ops.pagedllm.paged_decode_attention(q, k, v, kv, slots, tables, ctx, 0.25, None, ks, vs)
    assert torch.equal(kv.view(torch.uint8), eager_kv.view(torch.uint8)) and torch.equal(got, want)
    with pytest.raises(ValueError, match="needs the layer's k_scale"):
        torch.ops.pagedllm.paged_decode_attention(q, k, v, kv, slots, tables, ctx, 0.25, None)


@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_compiled_graph_mutates_an_fp8_cache_in_place():
    """Under torch.compile (inductor, as the decode graphs) the op is one node that writes the
    fp8 cache input in place and reads the scale inputs (the run is ~4 s of compiling)."""
    q, k, v, kv, slots, tables, ctx, ks, vs = _op_case(E4M3)
    eager_kv = kv.clone()
    want = decode_op.paged_decode_attention_eager(q, k, v, eager_kv, slots, tables, ctx, 0.25, None, ks, vs)

    def step(q, k, v, kv, slots, tables, ctx, ks, vs):
        return torch.ops.pagedllm.paged_decode_attention(q * 1.0, k, v, kv, slots, tables, ctx, 0.25, None, ks, vs) + 1

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, dynamic=False)(q, k, v, kv, slots, tables, ctx, ks, vs)
    assert torch.equal(kv.view(torch.uint8), eager_kv.view(torch.uint8))
    torch.testing.assert_close(got, want + 1, rtol=0, atol=0)


# ---- copy-on-write and swap ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_blocks_copied_and_swapped_keep_their_values(dtype):
    """The scales are the layer's, so a block's bytes are all there is to move: a copied block
    and a block swapped out, overwritten on the device and swapped back read as before."""
    eng = CacheEngine(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=6, block_size=4, dtype=dtype, device="cpu")
    eng.allocate_host_pool(3)
    g = torch.Generator().manual_seed(6)
    scales = [torch.rand(2, generator=g) + 0.1 for _ in range(2)]
    halves = [F.split_kv_cache(kv, 2, 8, scales[0], scales[1]) for kv in eng.kv_caches]
    for layer in halves:
        for half in layer:
            F.write_rows(half, torch.randn(24, 2, 8, generator=g), torch.arange(24))

    def read(layer, h, block):
        return F.dequantize(halves[layer][h])[block].clone()

    before = {(layer, h, b): read(layer, h, b) for layer in range(2) for h in range(2) for b in range(6)}
    assert not torch.equal(before[0, 0, 1], before[0, 0, 4])
    eng.copy_blocks([(1, 4)])
    assert all(torch.equal(read(layer, h, 4), before[layer, h, 1]) for layer in range(2) for h in range(2))
    eng.swap_out([(2, 0), (5, 2)])
    for layer in halves:
        for half in layer:
            F.write_rows(half, torch.randn(8, 2, 8, generator=g), torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]))
    eng.swap_in([(0, 3), (2, 1)])
    for layer in range(2):
        for h in range(2):
            assert torch.equal(read(layer, h, 3), before[layer, h, 2])
            assert torch.equal(read(layer, h, 1), before[layer, h, 5])
    assert eng._host_cache.dtype == dtype


# ---- the Attention layer's scales ---------------------------------------------------------

def test_attention_scale_buffers():
    attn = Attention(num_heads=4, head_dim=8, scale=0.3, num_kv_heads=2)
    assert attn.k_scale.tolist() == [1.0, 1.0] and attn.v_scale.dtype == torch.float32
    assert "k_scale" not in attn.state_dict() and {n for n, _ in attn.named_buffers()} == {"k_scale", "v_scale"}
    attn.load_kv_scale("k_scale", torch.tensor(0.25))  # one scale: every KV head
    attn.load_kv_scale("v_scale", torch.tensor([[[0.5]], [[2.0]]]))  # [Hk, 1, 1], per head
    assert attn.k_scale.tolist() == [0.25, 0.25] and attn.v_scale.tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"one scale or one per KV head \(2\), got shape \(3,\)"):
        attn.load_kv_scale("k_scale", torch.ones(3))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive and finite"):
            attn.load_kv_scale("v_scale", torch.tensor([bad]))
    assert attn.v_scale.tolist() == [0.5, 2.0]


@pytest.mark.parametrize("dtype", [E4M3, torch.float32], ids=["e4m3", "f32"])
def test_attention_layer_passes_its_scales_to_the_backend(dtype):
    """A prompt through the layer: an fp8 cache holds x / k_scale (per head); a float cache
    ignores the scales and holds x itself."""
    g = torch.Generator().manual_seed(8)
    attn = Attention(num_heads=4, head_dim=8, scale=8**-0.5, num_kv_heads=2)
    attn.load_kv_scale("k_scale", torch.tensor([0.5, 4.0]))
    q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    md = AttentionMetadata(slot_mapping=torch.arange(5), block_size=8, prefill_query_starts=[0],
                           prefill_query_lens=[5], prefill_context_lens=[5],
                           prefill_block_tables=[torch.tensor([0])])
    kv = torch.zeros(2, 2, 8, 2, 8, dtype=dtype)
    out = attn(q, k, v, kv, md)
    assert out.shape == (5, 32)
    stored = kv[0, 0, :5].float()
    if dtype == E4M3:
        torch.testing.assert_close(stored, _nearest_fp8(k / torch.tensor([0.5, 4.0])[None, :, None], E4M3),
                                   rtol=0, atol=0)
    else:
        assert torch.equal(stored, k)
