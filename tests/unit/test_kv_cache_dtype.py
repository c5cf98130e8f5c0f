"""KV cache element types without a model: the layout and its sizes, bfloat16 rounding (both C
paths against torch), int8 quantization of incremental writes (requantization when a block's
scale grows, a fresh start at offset 0, error bounds), block copies and swaps that carry the
scales, and bad values."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.kernels import build as kernel_build
from pagedllm.layers import kv_cache_dtype as F
from pagedllm.worker.cache_engine import CacheEngine

I8, BF16 = torch.int8, torch.bfloat16
_G = torch.Generator()  # every draw below is seeded, per test: no test depends on luck or order


@pytest.fixture(autouse=True)
def _seeded():
    _G.manual_seed(7)


def _int8_half(num_blocks, block_size, hk, d):
    kv = torch.zeros(F.layer_shape(I8, num_blocks, block_size, hk, d), dtype=I8)
    return kv, F.split_kv_cache(kv, hk, d)


# ---- layout and sizes ---------------------------------------------------------------------

def test_bytes_per_block_of_each_dtype_smollm2_shape():
    """SmolLM2-135M: 30 layers, 3 KV heads of 64, blocks of 16. bfloat16 is exactly half of
    float32; int8 a quarter plus one float32 scale per (K or V, layer, KV head) padded to 16."""
    sizes = {dt: CacheEngine.bytes_per_block(30, 3, 64, 16, dt) for dt in (torch.float32, BF16, I8)}
    assert sizes[torch.float32] == 2 * 30 * 16 * 3 * 64 * 4 == 737280
    assert sizes[BF16] * 2 == sizes[torch.float32]
    assert sizes[I8] == 2 * 30 * (16 + 16 * 3 * 64) == 185280
    assert 3.9 < sizes[torch.float32] / sizes[I8] < 4.0


def test_int8_views_alias_the_raw_blocks():
    kv, (keys, values) = _int8_half(num_blocks=3, block_size=4, hk=5, d=8)
    assert kv.shape == (2, 3, 32 + 4 * 5 * 8)  # 5 scales = 20 bytes, padded to 32
    assert keys.shape == (3, 4, 5, 8) and keys.scales.shape == (3, 5)
    values.scales[1, 2] = 1.5
    values.codes[1, 3, 4, 7] = -7
    raw = kv[1, 1]
    assert raw[8:12].view(torch.float32).item() == 1.5
    assert raw[-1].item() == -7
    assert not kv[0].any()


def test_int8_needs_a_multiple_of_four_bytes_per_block():
    with pytest.raises(ValueError, match="multiple of 4"):
        F.block_bytes(I8, 1, 1, 3)


# ---- bad values ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["fp8_e4m3fnuz", "int4", "float64", "", "INT8"])
def test_unknown_kv_cache_dtype_is_a_value_error(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        F.resolve_kv_cache_dtype(bad, torch.float32)


def test_cli_flag():
    from pagedllm.entrypoints.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "--kv-cache-dtype", "int8", "hi"]).kv_cache_dtype == "int8"
    assert parser.parse_args(["generate", "hi"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--kv-cache-dtype", "fp4", "hi"])


def test_auto_is_the_model_dtype():
    assert F.resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert F.resolve_kv_cache_dtype("auto", BF16) == BF16
    assert F.resolve_kv_cache_dtype("int8", BF16) == I8


# ---- bfloat16 rounding --------------------------------------------------------------------

def _special_floats() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    # Exact ties between two bfloat16 values (round to even both ways), and near-ties.
    base = torch.randn(256, generator=g).to(BF16).float()
    half_ulp = base.abs() * 2.0**-8
    ties = torch.cat([base + half_ulp, base - half_ulp, base + half_ulp * 1.0001, base + half_ulp * 0.9999])
    edge = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.3895314e38, -3.3895314e38, 3.4028235e38, float("inf"),
                         float("-inf"), 1.1754944e-38])
    return torch.cat([normal, ties, edge]).contiguous()


def _c_round(x: torch.Tensor, portable: bool) -> torch.Tensor:
    fn = kernel_build.bf16_round_kernel()
    out = torch.empty(x.shape, dtype=torch.int16)
    fn(x.data_ptr(), out.data_ptr(), x.numel(), int(portable))
    return out.view(BF16)


needs_kernel = pytest.mark.skipif(kernel_build.decode_attention_kernel() is None, reason="no C compiler")


@needs_kernel
@pytest.mark.parametrize("portable", [True, False], ids=["integer-ops", "native"])
def test_c_bf16_rounding_equals_torch(portable):
    """Both paths (the integer fallback, and VCVTNEPS2BF16 where this CPU has it) round to
    nearest even exactly as torch does, ties, overflow to inf and infinities included."""
    x = _special_floats()
    got, want = _c_round(x, portable), x.to(BF16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_kernel
def test_c_bf16_rounding_of_nan_and_denormals():
    x = torch.tensor([float("nan"), -float("nan"), 1e-39, -3e-40, 5e-45] + [0.0] * 11)
    port = _c_round(x, portable=True)
    assert torch.isnan(port[:2]).all()
    assert torch.equal(port[2:].view(torch.int16), x[2:].to(BF16).view(torch.int16))  # denormals kept
    native = _c_round(x, portable=False).float()
    assert torch.isnan(native[:2]).all()
    # The instruction flushes denormal inputs to zero; the integer path keeps them: either way
    # they are below bfloat16's smallest normal.
    assert (native[2:].abs() <= 1.2e-38).all()


# ---- int8 incremental writes --------------------------------------------------------------

def test_int8_one_shot_block_is_absmax_quantized():
    _, (keys, _) = _int8_half(num_blocks=4, block_size=8, hk=2, d=16)
    x = torch.randn(8, 2, 16, generator=_G)
    F.write_rows(keys, x, torch.arange(16, 24))  # all of block 2 in one write
    scale = x.abs().amax(dim=(0, 2)) / 127
    torch.testing.assert_close(keys.scales[2], scale, rtol=1e-6, atol=0)
    assert keys.codes[2].abs().amax().item() == 127
    err = (F.dequantize(keys)[2] - x).abs()
    assert (err <= scale[None, :, None] * 0.5 * (1 + 1e-5)).all()


def test_int8_growing_scale_requantizes_earlier_tokens():
    """Token 0 is small, token 1 ten times larger: the block's scale grows at token 1, and token
    0's codes must be requantized (read with the new scale unchanged, they would be 10x off)."""
    _, (keys, _) = _int8_half(num_blocks=2, block_size=4, hk=1, d=16)
    small, large = torch.randn(1, 1, 16, generator=_G), torch.randn(1, 1, 16, generator=_G) * 10
    F.write_rows(keys, small, torch.tensor([4]))
    s0 = keys.scales[1, 0].item()
    F.write_rows(keys, large, torch.tensor([5]))
    s1 = keys.scales[1, 0].item()
    assert s1 > 5 * s0
    got = F.dequantize(keys)[1]
    assert (got[0] - small[0]).abs().max() <= s1 * 0.5 + s0 * 0.5 + 1e-7  # one requantization
    assert (got[1] - large[0]).abs().max() <= s1 * 0.5 * (1 + 1e-5)
    F.write_rows(keys, small * 0.5, torch.tensor([6]))  # a smaller token keeps the scale
    assert keys.scales[1, 0].item() == s1


def test_int8_write_at_offset_zero_starts_the_block_afresh():
    """A block taken again (freed by another sequence) carries a stale, large scale: a write at
    its offset 0 ignores it."""
    _, (keys, _) = _int8_half(num_blocks=2, block_size=4, hk=1, d=16)
    F.write_rows(keys, torch.randn(4, 1, 16, generator=_G) * 100, torch.arange(4, 8))
    x = torch.randn(1, 1, 16, generator=_G) * 0.01
    F.write_rows(keys, x, torch.tensor([4]))
    torch.testing.assert_close(keys.scales[1, 0], x.abs().max() / 127, rtol=1e-6, atol=0)
    assert (F.dequantize(keys)[1, 0] - x[0]).abs().max() <= x.abs().max() / 254 * (1 + 1e-5)


def test_int8_token_by_token_error_stays_small():
    """Decode-like: 64 blocks filled one token per step; then the same rows written at once.
    Requantization adds error only at a block's record tokens."""
    g = torch.Generator().manual_seed(1)
    B, hk, d, nb = 16, 3, 64, 64
    x = torch.randn(nb * B, hk, d, generator=g) * torch.rand(nb * B, 1, 1, generator=g) * 4
    _, (inc, once) = _int8_half(nb, B, hk, d)
    slots = torch.arange(nb * B)
    for t in range(B):  # step t writes offset t of every block
        F.write_rows(inc, x[t::B], slots[t::B])
    F.write_rows(once, x, slots)
    assert torch.equal(inc.scales, once.scales)  # the final scale is the block's absmax either way
    scale = once.scales.repeat_interleave(B, 0)[:, :, None]
    e_once = (F.dequantize(once).reshape(-1, hk, d) - x).abs() / scale
    e_inc = (F.dequantize(inc).reshape(-1, hk, d) - x).abs() / scale
    assert e_once.max() <= 0.5 * (1 + 1e-5)
    assert e_inc.mean() < 0.35 and e_inc.max() < 2.0  # in code steps of the final scale
    assert e_inc.mean() > e_once.mean()  # requantization did happen


def test_float_caches_round_on_write():
    cache = torch.zeros(3, 4, 2, 8, dtype=BF16)
    x = torch.randn(5, 2, 8, generator=_G)
    slots = torch.tensor([0, 3, 4, 9, 11])
    F.write_rows(cache, x, slots)
    assert torch.equal(cache.view(-1, 2, 8)[slots], x.to(BF16))
    assert F.gather_blocks(cache, torch.tensor([2, 0]), torch.float32).dtype == torch.float32


# ---- copy-on-write and swap carry the scales ----------------------------------------------

def _filled_int8_engine(num_blocks=6, block_size=4):
    eng = CacheEngine(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=num_blocks, block_size=block_size,
                      dtype=I8, device="cpu")
    g = torch.Generator().manual_seed(2)
    for layer, kv in enumerate(eng.kv_caches):
        for half in F.split_kv_cache(kv, 2, 8):
            rows = torch.randn(num_blocks * block_size, 2, 8, generator=g) * (layer + 1) * torch.rand(1, generator=g)
            F.write_rows(half, rows, torch.arange(num_blocks * block_size))
    return eng


def _block(eng, layer, half, block):
    codes_scales = F.split_kv_cache(eng.kv_caches[layer], 2, 8)[half]
    return F.dequantize(codes_scales)[block], codes_scales.scales[block].clone()


def test_int8_copy_on_write_carries_scales_and_continues_writing():
    """A forked sequence's partly filled block (2 of 4 tokens) is copied, then the child writes
    its third token into the copy: the copy must hold the source's scales, or the two tokens
    already there would be read with another block's scale."""
    eng = _filled_int8_engine()
    want = [[_block(eng, layer, h, 1) for h in (0, 1)] for layer in range(2)]
    assert all(w[1].ne(_block(eng, layer, h, 4)[1]).all() for layer in range(2) for h, w in enumerate(want[layer]))
    eng.copy_blocks([(1, 4)])
    for layer in range(2):
        for h in (0, 1):
            values, scales = _block(eng, layer, h, 4)
            assert torch.equal(scales, want[layer][h][1])
            assert torch.equal(values, want[layer][h][0])
    # The child's next token at offset 2 of the copy, against the same write into the source.
    new = torch.randn(1, 2, 8, generator=_G) * 50  # larger than anything: the scale grows, tokens 0-1 requantize
    child = F.split_kv_cache(eng.kv_caches[0], 2, 8)[0]
    parent = F.split_kv_cache(eng.kv_caches[0].clone(), 2, 8)[0]
    F.write_rows(child, new, torch.tensor([4 * 4 + 2]))
    F.write_rows(parent, new, torch.tensor([1 * 4 + 2]))
    assert torch.equal(F.dequantize(child)[4, :3], F.dequantize(parent)[1, :3])


def test_int8_swap_out_and_in_carries_scales():
    eng = _filled_int8_engine()
    eng.allocate_host_pool(3)
    want = [[_block(eng, layer, h, b) for h in (0, 1) for b in (2, 5)] for layer in range(2)]
    eng.swap_out([(2, 0), (5, 2)])
    for kv in eng.kv_caches:  # the device blocks are reused by others meanwhile
        for half in F.split_kv_cache(kv, 2, 8):
            F.write_rows(half, torch.randn(8, 2, 8, generator=_G) * 1e-3, torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]))
    eng.swap_in([(2, 3), (0, 1)])
    for layer in range(2):
        got = [_block(eng, layer, h, b) for h in (0, 1) for b in (1, 3)]
        for (gv, gs), (wv, ws) in zip(got, want[layer]):
            assert torch.equal(gs, ws) and torch.equal(gv, wv)


def test_host_pool_has_the_int8_layout():
    eng = _filled_int8_engine()
    eng.allocate_host_pool(4)
    assert eng._host_cache.shape == (2, 2, 4, eng.kv_caches[0].shape[-1]) and eng._host_cache.dtype == I8
