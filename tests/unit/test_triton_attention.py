"""The Triton paged-attention kernels (layers/backends/triton_attention.py) against a float64
reference over the cache's (dequantized) values.

Device: CUDA tensors and the compiled kernels where a GPU is present (benchmarks/gpu_check.sh on
the H200), else CPU tensors in Triton's interpreter (`TRITON_INTERPRET=1`, set per test with
monkeypatch; the module jits its kernels per mode on first use). The interpreter runs the
kernels' own code (masks, block-table gathers, split-K, online softmax) but compiles nothing, so
`test_compiles_to_cuda_binary` compiles every kernel for sm_80 / sm_90 with the arguments the
wrappers would launch with (Triton's own argument specialization): dot shapes, dtype rules,
register spills.

Reference: per sequence, the keys / values of its first `ctx` positions gathered from the
float64 view of the cache (fp8: stored value x scale), bottom-right causal (query i at
`ctx - qlen + i`), window `qpos - window < kpos <= qpos`, softmax in float64. Tolerances: float32
queries 2e-5 (float32 sums of <= 1000 terms of unit scale); float16 1e-3 and bfloat16 2e-2
absolute (the probabilities enter the second dot in the query's dtype, the output is rounded
once; the interpreter converts float32 to bfloat16 by truncation, a full ulp).

Block tables: shuffled block ids, and every entry a sequence does not use (past its context,
before its window) points at a poison block of NaN: a kernel that let one of those rows into a
result would return NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.layers.backends import triton_attention as ta
from pagedllm.layers.backends import triton_attention_checks as ta_checks
from pagedllm.layers.backends import triton_attention_kernels as ta_kernels
from pagedllm.layers.backends import triton_attention_tiles as ta_tiles
from tests.unit.triton_checks import assert_needs_triton_without_it, compile_to_cubin, needs_ptxas
from tests.triton_cache import triton_compile_cache

needs_triton = pytest.mark.skipif(not ta_kernels.HAS_TRITON, reason="triton is not installed (pip install triton): the "
                                  "kernels cannot run, not even in Triton's CPU interpreter")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}
interpreter_fp8_store = pytest.mark.skipif(
    not CUDA, reason="Triton 3.7's interpreter rounds float32 -> fp8 wrongly (runtime/interpreter.py _convert_float "
    "adds the first cut-off bit to the mantissa without carrying into the exponent: 7.93 -> 4.0 in e4m3fn, -0.497 -> "
    "-0.25 in e5m2; e4m3 subnormals: 0.003 -> 2**-9); its fp8 loads are exact (the fp8 attention tests run there), "
    "and so are stores of representable values (test_write_kv_cache_fp8_exact_values_and_clamp)")


@pytest.fixture
def mode(monkeypatch):
    """Compiled kernels on CUDA, the interpreter on CPU."""
    if CUDA:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Cache:
    """A random paged cache half pair with its float64 values (`kd`, `vd`), fp8 scales, and a
    NaN poison block (id `poison`) for unused block-table entries."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed, scale_range=(0.01, 0.1)):
        g = gen(seed)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        kx, vx = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        self.k_scale = self.v_scale = None
        if dtype in FP8:
            lo, hi = scale_range
            self.k_scale = lo + (hi - lo) * torch.rand(num_kv_heads, generator=g)
            self.v_scale = lo + (hi - lo) * torch.rand(num_kv_heads, generator=g)
            kc = (kx / self.k_scale[:, None]).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
            vc = (vx / self.v_scale[:, None]).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
            self.kd = kc.double() * self.k_scale.double()[:, None]
            self.vd = vc.double() * self.v_scale.double()[:, None]
        else:
            kc, vc = kx.to(dtype), vx.to(dtype)
            self.kd, self.vd = kc.double(), vc.double()
        self.poison = num_blocks - 1
        if dtype in FP8:
            kc[self.poison] = torch.tensor(float("nan")).to(dtype)
            vc[self.poison] = torch.tensor(float("nan")).to(dtype)
        else:
            kc[self.poison] = vc[self.poison] = float("nan")
        self.kd[self.poison] = self.vd[self.poison] = float("nan")
        self.key, self.value = kc.to(DEVICE), vc.to(DEVICE)
        self.block_size, self.num_blocks = block_size, num_blocks
        if self.k_scale is not None:
            self.k_scale, self.v_scale = self.k_scale.to(DEVICE), self.v_scale.to(DEVICE)

    def tables(self, ctx_lens, seed, width=None, first_visible=None):
        """Shuffled distinct block ids for every sequence's used blocks; poison past them and in
        the blocks wholly before `first_visible[s]` (the sequence's earliest visible key)."""
        B = self.block_size
        need = [-(-c // B) for c in ctx_lens]
        width = width or max(need)
        ids = torch.randperm(self.num_blocks - 1, generator=gen(seed)).tolist()
        assert sum(need) <= len(ids), "cache too small for the test"
        table = torch.full((len(ctx_lens), width), self.poison, dtype=torch.int32)
        for s, (c, n) in enumerate(zip(ctx_lens, need)):
            first = first_visible[s] // B if first_visible else 0
            for j in range(n):
                bid = ids.pop()
                if j >= first:
                    table[s, j] = bid
        return table


def reference(q, cache, tables, ctx_lens, q_lens, scale, window=None, softcap=None):
    """float64 attention of `q [T, Hq, D]` (sequences' queries back to back); `softcap`: scaled
    scores s become `softcap * tanh(s / softcap)` (Gemma 2) before the mask."""
    T, Hq, D = q.shape
    Hk, B = cache.kd.shape[2], cache.block_size
    G = Hq // Hk
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    start = 0
    for s, (c, ql) in enumerate(zip(ctx_lens, q_lens)):
        nb = -(-c // B)
        blocks = tables[s, :nb].long().cpu()
        k = cache.kd[blocks].reshape(-1, Hk, D)[:c].repeat_interleave(G, 1)  # [c, Hq, D]
        v = cache.vd[blocks].reshape(-1, Hk, D)[:c].repeat_interleave(G, 1)
        qpos = torch.arange(c - ql, c)[:, None]
        kpos = torch.arange(c)[None, :]
        vis = kpos <= qpos
        if window:
            vis &= kpos > qpos - window
        qs = q[start:start + ql].double().cpu()
        scores = torch.einsum("qhd,khd->hqk", qs, k.nan_to_num(0.0)) * scale  # poison before the window: 0
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        p = torch.softmax(torch.where(vis[None], scores, -math.inf), -1)
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", p, v.nan_to_num(0.0))
        start += ql
    return out


def check(out, ref, dtype, what=""):
    assert out.shape == ref.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (a poison block was read into a result)"
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype], msg=lambda m: f"{what}: {m}")


def run_decode(cache, ctx_lens, Hq, dtype, seed, window=None, num_splits=None, scale=None, width=None, softcap=None,
               q_std=1.0, **kw):
    D = cache.key.shape[3]
    q = (torch.randn(len(ctx_lens), Hq, D, generator=gen(seed)) * q_std).to(dtype)
    tables = cache.tables(ctx_lens, seed, width=width, first_visible=[max(0, c - window) for c in ctx_lens]
                          if window else None)
    scale = scale or D ** -0.5
    out = ta.paged_decode_attention(q.to(DEVICE), cache.key, cache.value, tables.to(DEVICE),
                                    torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale,
                                    sliding_window=window, k_scale=cache.k_scale, v_scale=cache.v_scale,
                                    num_splits=num_splits, logits_soft_cap=softcap, **kw)
    return out, reference(q, cache, tables, ctx_lens, [1] * len(ctx_lens), scale, window, softcap)


def run_prefill(cache, ctx_lens, q_lens, Hq, dtype, seed, window=None, scale=None, softcap=None, q_std=1.0):
    D = cache.key.shape[3]
    T = sum(q_lens)
    q = (torch.randn(T, Hq, D, generator=gen(seed)) * q_std).to(dtype)
    tables = cache.tables(ctx_lens, seed, first_visible=[max(0, c - ql - window + 1) for c, ql in zip(ctx_lens, q_lens)]
                          if window else None)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = scale or D ** -0.5
    out = ta.paged_prefill_attention(q.to(DEVICE), cache.key, cache.value, tables.to(DEVICE), qsl,
                                     torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), scale, max(q_lens),
                                     sliding_window=window, k_scale=cache.k_scale, v_scale=cache.v_scale,
                                     logits_soft_cap=softcap)
    return out, reference(q, cache, tables, ctx_lens, q_lens, scale, window, softcap)


# ---- decode ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("Hq,Hk", [(9, 3), (4, 1), (4, 4)])
@needs_triton
def test_decode(mode, Hq, Hk, block_size):
    """GQA (SmolLM2's 9 / 3), MQA and MHA; contexts of 1 token, exactly one and three blocks,
    and ragged ones; the default split count."""
    cache = Cache(24, block_size, Hk, 64, torch.float32, seed=Hq + Hk + block_size)
    ctx = [1, block_size, 3 * block_size, 2 * block_size + 5, 37]
    out, ref = run_decode(cache, ctx, Hq, torch.float32, seed=block_size)
    check(out, ref, torch.float32)


@needs_triton
def test_decode_splits_agree(mode):
    """Long contexts: split-K with several splits (the default picks 3 here: 832 slots / 256),
    more splits than a short sequence has tiles (neutral partials), and one split, all equal the
    reference and each other to float32 rounding."""
    cache = Cache(60, 16, 1, 64, torch.float32, seed=5)
    ctx = [800, 1, 95]
    assert ta_tiles.default_num_splits(3, 1, 52, 16, torch.device("cpu")) == 3
    outs = {}
    for n in (None, 1, 2, 7):
        outs[n], ref = run_decode(cache, ctx, 4, torch.float32, seed=6, num_splits=n, width=52)
        check(outs[n], ref, torch.float32, f"num_splits={n}")
    for n in (None, 2, 7):
        torch.testing.assert_close(outs[n], outs[1], atol=1e-6, rtol=1e-5)


@needs_triton
def test_decode_matches_decode_attention_torch(mode):
    """The project's portable decode (gather + SDPA) gives the same numbers."""
    from pagedllm.layers.backends.decode_op import decode_attention_torch

    cache = Cache(20, 16, 3, 64, torch.float32, seed=9)
    cache.key[cache.poison] = cache.value[cache.poison] = 0.0  # SDPA multiplies masked keys by 0: no NaN there
    ctx = [1, 16, 70]
    q = torch.randn(3, 9, 64, generator=gen(1), device="cpu").to(DEVICE)
    tables = cache.tables(ctx, seed=2).to(DEVICE)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    want = decode_attention_torch(q, cache.key, cache.value, tables, lens, 0.125, None)
    for n in (1, 3):
        got = ta.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.125, num_splits=n)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window,splits", [(1, 1), (7, 2), (40, 3), (200, 1)])
@needs_triton
def test_decode_sliding_window(mode, window, splits):
    """Keys at positions <= qpos - window are hidden (the blocks wholly before it are poison)."""
    cache = Cache(40, 8, 3, 64, torch.float32, seed=window)
    ctx = [1, 7, 8, 41, 150]
    out, ref = run_decode(cache, ctx, 9, torch.float32, seed=window, window=window, num_splits=splits)
    check(out, ref, torch.float32, f"window {window}")


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
@needs_triton
def test_decode_dtypes(mode, q_dtype, cache_dtype):
    cache = Cache(16, 16, 3, 64, cache_dtype, seed=3)
    out, ref = run_decode(cache, [1, 20, 90], 9, q_dtype, seed=4, num_splits=2)
    check(out, ref, q_dtype)


@pytest.mark.parametrize("head_dim", [80, 96, 128])
@needs_triton
def test_decode_head_dims(mode, head_dim):
    """head_dim padded to a power of two inside the kernel (masked lanes)."""
    cache = Cache(12, 16, 2, head_dim, torch.float32, seed=head_dim)
    out, ref = run_decode(cache, [5, 33, 64], 8, torch.float32, seed=head_dim, num_splits=2)
    check(out, ref, torch.float32)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
@needs_triton
def test_decode_fp8(mode, cache_dtype, q_dtype):
    """fp8 caches with a scale per KV head: the kernel sees stored x scale."""
    if cache_dtype == torch.float8_e4m3fn and CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9")
    cache = Cache(16, 16, 3, 64, cache_dtype, seed=7)
    out, ref = run_decode(cache, [1, 17, 100], 9, q_dtype, seed=8, num_splits=2)
    check(out, ref, q_dtype)


@needs_triton
def test_decode_graph_padding_out_and_strided_query(mode):
    """What a CUDA-graph batch looks like: padded rows (context 1, a table of scratch block 0)
    next to real ones; the query a strided view into a fused qkv output; `out` a strided view
    written in place."""
    cache = Cache(16, 16, 3, 64, torch.float32, seed=11)
    ctx = [33, 1, 1]
    tables = cache.tables(ctx, seed=3)
    tables[1:] = 0
    qkv = torch.randn(3, (9 + 6) * 64, generator=gen(4)).to(DEVICE)
    q = qkv[:, : 9 * 64].view(3, 9, 64)
    big = torch.full((3, 9, 80), 7.0, device=DEVICE)
    out = big[:, :, :64]
    got = ta.paged_decode_attention(q, cache.key, cache.value, tables.to(DEVICE),
                                    torch.tensor(ctx, device=DEVICE), 0.125, num_splits=2, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert (big[:, :, 64:] == 7.0).all()
    check(out, reference(q.cpu(), cache, tables, ctx, [1, 1, 1], 0.125), torch.float32)


# ---- prefill ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("Hq,Hk", [(9, 3), (4, 4)])
@needs_triton
def test_prefill_without_context(mode, Hq, Hk, block_size):
    """Plain prompts of mixed lengths in one varlen batch (1 token, a block, ragged)."""
    cache = Cache(24, block_size, Hk, 64, torch.float32, seed=block_size + Hk)
    q_lens = [1, block_size, 45, 3]
    out, ref = run_prefill(cache, q_lens, q_lens, Hq, torch.float32, seed=block_size)
    check(out, ref, torch.float32)


@pytest.mark.parametrize("Hq,Hk", [(9, 3), (4, 1)])
@needs_triton
def test_prefill_with_context(mode, Hq, Hk):
    """Chunks over cached context (chunked prefill, prefix-cache hit) mixed with a plain prompt:
    bottom-right causal."""
    cache = Cache(30, 16, Hk, 64, torch.float32, seed=Hq)
    q_lens = [7, 1, 20, 12]
    ctx_lens = [7 + 0, 1 + 64, 20 + 33, 12 + 90]
    out, ref = run_prefill(cache, ctx_lens, q_lens, Hq, torch.float32, seed=Hq)
    check(out, ref, torch.float32)


@pytest.mark.slow  # the interpreter over a 200-token prefill: ~1.5 s a window
@pytest.mark.parametrize("window", [1, 5, 16, 40, 200])
@needs_triton
def test_prefill_sliding_window(mode, window):
    """Chunks and a 100-token prompt whose later query rows see nothing in its first key steps
    (the -inf-safe softmax); with window 200 the chunk over 270 cached tokens has key steps
    every query sees (no mask) between steps cut by the window and by causality."""
    cache = Cache(80, 8, 3, 64, torch.float32, seed=window)
    q_lens = [30, 9, 4, 100, 30]
    ctx_lens = [30, 60, 100, 100, 300]
    out, ref = run_prefill(cache, ctx_lens, q_lens, 9, torch.float32, seed=window, window=window)
    check(out, ref, torch.float32, f"window {window}")


@pytest.mark.parametrize("window", [None, "step + 2"])
@needs_triton
def test_prefill_mask_boundaries(mode, window):
    """Key steps are unmasked only when every query of the tile sees all of them: contexts swept
    across the step boundary where the step is exactly inside (context 2 * step + 2 with the
    window step + 2), one token short of it on either side (causal, window) and beyond."""
    step = ta_tiles._prefill_config(3, 64, 3, torch.float32, (9, 0))["BLOCK_N"]
    window = step + 2 if window else None
    ctx_lens = list(range(2 * step - 2, 2 * step + 6))
    cache = Cache(len(ctx_lens) * (-(-ctx_lens[-1] // 16)) + 1, 16, 3, 64, torch.float32, seed=17)
    out, ref = run_prefill(cache, ctx_lens, [3] * len(ctx_lens), 9, torch.float32, seed=18, window=window)
    check(out, ref, torch.float32, f"window {window}")


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float8_e4m3fn),
                                                 (torch.float16, torch.float8_e5m2),
                                                 (torch.float32, torch.float8_e4m3fn)])
@needs_triton
def test_prefill_dtypes(mode, q_dtype, cache_dtype):
    if cache_dtype == torch.float8_e4m3fn and CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9")
    cache = Cache(20, 16, 3, 64, cache_dtype, seed=12)
    out, ref = run_prefill(cache, [25, 40], [25, 9], 9, q_dtype, seed=13)
    check(out, ref, q_dtype)


@pytest.mark.parametrize("head_dim", [80, 128])
@needs_triton
def test_prefill_head_dims(mode, head_dim):
    cache = Cache(12, 16, 2, head_dim, torch.float32, seed=head_dim)
    out, ref = run_prefill(cache, [19, 40], [19, 6], 4, torch.float32, seed=head_dim)
    check(out, ref, torch.float32)


@needs_triton
def test_write_then_prefill_whole_or_chunked_then_decode(mode):
    """The caller's sequence of calls: write a prompt's K/V (strided views of a fused qkv), run
    its prefill whole, or in two chunks each written first; the same numbers either way; then
    one decode step after writing the next token."""
    Hq, Hk, D, B = 9, 3, 64, 16
    key_cache = torch.zeros(12, B, Hk, D, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    L = 40
    qkv = torch.randn(L + 1, (Hq + 2 * Hk) * D, generator=gen(21)).to(DEVICE)
    q = qkv[:, : Hq * D].view(-1, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hk) * D].view(-1, Hk, D)
    v = qkv[:, (Hq + Hk) * D:].view(-1, Hk, D)
    table = torch.tensor([[7, 2, 9, 4]], dtype=torch.int32, device=DEVICE)
    slots = (table[0].long()[torch.arange(L + 1, device=DEVICE) // B] * B + torch.arange(L + 1, device=DEVICE) % B)

    def prefill(lo, hi):
        ta.write_kv_cache(k[lo:hi], v[lo:hi], key_cache, value_cache, slots[lo:hi])
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        ctx = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        return ta.paged_prefill_attention(q[lo:hi], key_cache, value_cache, table, qsl, ctx, D ** -0.5, hi - lo)

    whole = prefill(0, L)
    chunked = torch.cat([prefill(0, 23), prefill(23, L)])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)  # other tiles: float32 sums reordered
    ta.write_kv_cache(k[L:], v[L:], key_cache, value_cache, slots[L:])
    dec = ta.paged_decode_attention(q[L:], key_cache, value_cache, table, torch.tensor([L + 1], device=DEVICE),
                                    D ** -0.5, num_splits=2)
    # reference: plain causal attention over the fresh float32 K/V
    kk = k.double().cpu().repeat_interleave(Hq // Hk, 1)
    vv = v.double().cpu().repeat_interleave(Hq // Hk, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double().cpu(), kk) * D ** -0.5
    scores = scores.masked_fill(torch.ones(L + 1, L + 1, dtype=torch.bool).triu(1), -math.inf)
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv)
    check(whole, ref[:L], torch.float32)
    check(dec, ref[L:], torch.float32)


# ---- write -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@needs_triton
def test_write_kv_cache(mode, cache_dtype, slot_dtype):
    """Rows land at their slots (shuffled, across blocks) converted to the cache's dtype;
    negative slots (padding) are skipped; key / value are strided views of a fused qkv."""
    N, B, Hk, D, T = 6, 8, 3, 80, 12
    key_cache = torch.full((N, B, Hk, D), -5.0, dtype=cache_dtype, device=DEVICE)
    value_cache = key_cache.clone()
    qkv = torch.randn(T, (9 + 2 * Hk) * D, generator=gen(3)).to(DEVICE)
    k = qkv[:, 9 * D: (9 + Hk) * D].view(T, Hk, D)
    v = qkv[:, (9 + Hk) * D:].view(T, Hk, D)
    slots = torch.randperm(N * B, generator=gen(4))[:T]
    slots[[2, 7]] = -1
    ta.write_kv_cache(k, v, key_cache, value_cache, slots.to(DEVICE, slot_dtype))
    want_k = torch.full((N * B, Hk, D), -5.0, dtype=cache_dtype)
    want_v = want_k.clone()
    keep = slots >= 0
    want_k[slots[keep]] = k.cpu()[keep].to(cache_dtype)
    want_v[slots[keep]] = v.cpu()[keep].to(cache_dtype)
    # bfloat16 in the interpreter: float32 -> bfloat16 truncates (the GPU rounds), one ulp
    tol = dict(atol=0, rtol=0) if CUDA or cache_dtype != torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(key_cache.cpu().view(N * B, Hk, D), want_k, **tol)
    torch.testing.assert_close(value_cache.cpu().view(N * B, Hk, D), want_v, **tol)


@pytest.mark.parametrize("cache_dtype", FP8)
@needs_triton
def test_write_kv_cache_fp8_exact_values_and_clamp(mode, cache_dtype):
    """Values that are fp8 numbers times their head's scale store exactly (no rounding: this runs
    in the interpreter too), values beyond fmax x scale clamp to +-fmax, skipped rows stay."""
    if cache_dtype == torch.float8_e4m3fn and CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9")
    N, B, Hk, D, T = 4, 16, 2, 64, 10
    fmax = FP8_MAX[cache_dtype]
    g = gen(5)
    codes = (torch.randn(T, Hk, D, generator=g) * 4).to(cache_dtype).float()
    codes = torch.where(codes.abs() < 2.0 ** -6, 1.0, codes)  # normal numbers only (no subnormal rounding question)
    k_scale, v_scale = torch.tensor([0.5, 0.125]), torch.tensor([2.0, 0.25])
    k, v = codes * k_scale[:, None], -codes * v_scale[:, None]
    k[0, 0, :4] = torch.tensor([3 * fmax, -3 * fmax, fmax, -1e30]) * k_scale[0]
    slots = torch.arange(T) * 5 % (N * B)
    slots[3] = -1
    key_cache = torch.zeros(N, B, Hk, D, dtype=cache_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    ta.write_kv_cache(k.to(DEVICE), v.to(DEVICE), key_cache, value_cache, slots.to(DEVICE),
                      k_scale=k_scale.to(DEVICE), v_scale=v_scale.to(DEVICE))
    keep = slots >= 0
    want_k = torch.zeros(N * B, Hk, D)
    want_v = torch.zeros(N * B, Hk, D)
    want_k[slots[keep]] = (k / k_scale[:, None]).clamp(-fmax, fmax)[keep]
    want_v[slots[keep]] = (v / v_scale[:, None]).clamp(-fmax, fmax)[keep]
    assert torch.equal(key_cache.cpu().view(N * B, Hk, D).float(), want_k)
    assert torch.equal(value_cache.cpu().view(N * B, Hk, D).float(), want_v)


@interpreter_fp8_store
@pytest.mark.parametrize("cache_dtype", FP8)
@needs_triton
def test_write_kv_cache_fp8_rounding(mode, cache_dtype):
    """Random values: the bytes torch's clamp(x / scale).to(fp8) gives (IEEE division, one
    round-to-nearest-even conversion: cvt.rn.satfinite from float32, checked in the PTX below)."""
    if cache_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9")
    N, B, Hk, D, T = 8, 16, 4, 128, 100
    fmax = FP8_MAX[cache_dtype]
    g = gen(6)
    k, v = torch.randn(T, Hk, D, generator=g) * 3, torch.randn(T, Hk, D, generator=g) * 100
    k_scale, v_scale = torch.rand(Hk, generator=g) * 0.02 + 1e-3, torch.rand(Hk, generator=g) + 0.1
    slots = torch.randperm(N * B, generator=g)[:T]
    key_cache = torch.zeros(N, B, Hk, D, dtype=cache_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    ta.write_kv_cache(k.to(DEVICE), v.to(DEVICE), key_cache, value_cache, slots.to(DEVICE),
                      k_scale=k_scale.to(DEVICE), v_scale=v_scale.to(DEVICE))
    want_k = (k / k_scale[:, None]).clamp(-fmax, fmax).to(cache_dtype)
    want_v = (v / v_scale[:, None]).clamp(-fmax, fmax).to(cache_dtype)
    got_k = key_cache.cpu().view(N * B, Hk, D)[slots]
    got_v = value_cache.cpu().view(N * B, Hk, D)[slots]
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


# ---- capture safety, checks, the optional import --------------------------------------------------

@needs_triton
def test_wrappers_read_no_device_values(monkeypatch):
    """CUDA-graph safety on any machine: building every launch reads no tensor value on the host
    (no .item() / .tolist() / bool / int of a tensor), and grids are host ints."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    monkeypatch.setattr(ta, "_run", launches.append)
    cache = Cache(8, 16, 3, 64, torch.float8_e5m2, seed=1)
    q = torch.randn(4, 9, 64)
    tables = torch.zeros(4, 8, dtype=torch.int32)
    lens = torch.ones(4, dtype=torch.int32)

    def refuse(*a, **k):
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    ta.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.1, sliding_window=5,
                              k_scale=cache.k_scale, v_scale=cache.v_scale, num_splits=4)
    ta.paged_decode_attention(q, cache.key, cache.value, tables, lens, 0.1, k_scale=cache.k_scale,
                              v_scale=cache.v_scale)  # the default split count
    ta.paged_prefill_attention(q, cache.key, cache.value, tables[:2], torch.zeros(3, dtype=torch.int32), lens[:2],
                               0.1, 4, k_scale=cache.k_scale, v_scale=cache.v_scale)
    ta.write_kv_cache(q[:, :3], q[:, 3:6], cache.key, cache.value, lens.long(), cache.k_scale, cache.v_scale)
    monkeypatch.undo()
    assert [launch.kernel for launch in launches] == ["decode", "reduce", "decode", "prefill", "write"]
    for launch in launches:
        assert all(type(x) is int for x in launch.grid), launch.grid
        assert all(isinstance(a, (torch.Tensor, int, float)) for a in launch.args)


@needs_triton
def test_default_num_splits_from_shapes(monkeypatch):
    monkeypatch.setattr(ta_tiles, "_num_sms", lambda device: 132)  # an H200
    cpu = torch.device("cpu")
    assert ta_tiles.default_num_splits(1, 3, 256, 16, cpu) == 16  # one long sequence: splits by length (4096 / 256)
    assert ta_tiles.default_num_splits(8, 8, 2048, 16, cpu) == 5  # 64 programs: ~2 waves over 132 SMs
    assert ta_tiles.default_num_splits(64, 8, 2048, 16, cpu) == 1  # the batch alone fills the GPU
    assert ta_tiles.default_num_splits(2, 3, 8, 16, cpu) == 1  # 128 slots: too short to split
    assert ta_tiles.default_num_splits(1, 1, 100000, 16, cpu) == 64  # capped


@pytest.mark.parametrize("call,match", [
    ("decode_fp8_no_scale", "float8_e5m2 cache needs k_scale as a float32 tensor \\[3\\]"),
    ("decode_heads", "10 query heads are not a multiple of the cache's 3 KV heads"),
    ("decode_head_dim", "query head_dim 32 != the cache's head_dim 64"),
    ("decode_splits", "num_splits must be a positive int, got 0"),
    ("prefill_qsl", "query_start_loc must be int32 / int64 \\[3\\]"),
    ("write_shape", "must be \\[T, 3, 64\\]"),
    ("write_slots", "slot_mapping must be int32 / int64 \\[4\\]"),
])
@needs_triton
def test_input_errors(monkeypatch, call, match):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kc = torch.zeros(4, 16, 3, 64)
    f8 = kc.to(torch.float8_e5m2)
    q, bt, lens = torch.zeros(2, 9, 64), torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    calls = {
        "decode_fp8_no_scale": lambda: ta.paged_decode_attention(q, f8, f8, bt, lens, 0.1),
        "decode_heads": lambda: ta.paged_decode_attention(torch.zeros(2, 10, 64), kc, kc, bt, lens, 0.1),
        "decode_head_dim": lambda: ta.paged_decode_attention(torch.zeros(2, 9, 32), kc, kc, bt, lens, 0.1),
        "decode_splits": lambda: ta.paged_decode_attention(q, kc, kc, bt, lens, 0.1, num_splits=0),
        "prefill_qsl": lambda: ta.paged_prefill_attention(q, kc, kc, bt, torch.zeros(2, dtype=torch.int32), lens,
                                                          0.1, 1),
        "write_shape": lambda: ta.write_kv_cache(torch.zeros(4, 2, 64), torch.zeros(4, 2, 64), kc, kc,
                                                 torch.zeros(4, dtype=torch.int64)),
        "write_slots": lambda: ta.write_kv_cache(torch.zeros(4, 3, 64), torch.zeros(4, 3, 64), kc, kc,
                                                 torch.zeros(3, dtype=torch.int64)),
    }
    with pytest.raises(ValueError, match=match):
        calls[call]()


@needs_triton
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kc = torch.zeros(4, 16, 3, 64)
    with pytest.raises(ValueError, match="tensors on cpu need TRITON_INTERPRET=1"):
        ta.paged_decode_attention(torch.zeros(2, 9, 64), kc, kc, torch.zeros(2, 4, dtype=torch.int32),
                                  torch.ones(2, dtype=torch.int32), 0.1)


@needs_triton
def test_e4m3_refused_before_sm89(monkeypatch):
    """Triton has no fp8e4nv type before compute capability 8.9: a clear error, not a compile one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ta_checks, "_capability", lambda device: (8, 0))
    kc = torch.zeros(4, 16, 3, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn KV cache needs a GPU of compute capability >= 8.9"):
        ta.paged_decode_attention(torch.zeros(2, 9, 64), kc, kc, torch.zeros(2, 4, dtype=torch.int32),
                                  torch.ones(2, dtype=torch.int32), 0.1, k_scale=torch.ones(3),
                                  v_scale=torch.ones(3))


@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_imports_without_triton():
    """With triton unimportable the modules still import, and the wrappers say what is missing."""
    assert_needs_triton_without_it("pagedllm.layers.backends.triton_attention_kernels",
                                   "from pagedllm.layers.backends import triton_attention as ta; "
                                   "ta.paged_decode_attention(None, None, None, None, None, 1.0)")


# ---- CUDA graphs (GPU only) ------------------------------------------------------------------------

@pytest.mark.gpu
@needs_triton
def test_decode_and_prefill_capture_in_a_cuda_graph(monkeypatch):
    """Captured once, replayed with other context lengths and block tables (the inputs a graph
    runner refreshes in place): the results follow the new inputs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = Cache(64, 16, 3, 64, torch.bfloat16, seed=31)
    S, W = 4, 16
    q = torch.randn(S, 9, 64, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(S, W, dtype=torch.int32, device="cuda")
    lens = torch.ones(S, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device="cuda")
    args = (q, cache.key, cache.value, tables, lens, 0.125)
    ta.paged_decode_attention(*args, num_splits=4)  # compile outside the capture
    ta.paged_prefill_attention(q, cache.key, cache.value, tables, qsl, lens, 0.125, 1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec = ta.paged_decode_attention(*args, num_splits=4)
        pre = ta.paged_prefill_attention(q, cache.key, cache.value, tables, qsl, lens, 0.125, 1)
    for seed, ctx in ((1, [200, 1, 37, 16]), (2, [5, 250, 1, 99])):
        new_tables = cache.tables(ctx, seed, width=W)
        tables.copy_(new_tables)
        lens.copy_(torch.tensor(ctx))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(q.cpu(), cache, new_tables, ctx, [1] * S, 0.125)
        check(dec, ref, torch.bfloat16, f"decode replay {seed}")
        check(pre, ref, torch.bfloat16, f"prefill replay {seed}")


# ---- logit soft-capping (Gemma 2's attn_logit_softcapping: the SOFTCAP constexpr) ---------------

@pytest.mark.parametrize("cap,window,splits", [(2.0, None, 1), (1.0, 7, 3), (50.0, None, 2)])
@needs_triton
def test_decode_softcap(mode, cap, window, splits):
    """Scores of a few units (queries x 3) capped at 1-2 (most of them bent), and at Gemma 2's 50;
    split-K and a window; the uncapped kernel's result differs (the check is not vacuous)."""
    cache = Cache(40, 8, 3, 64, torch.float32, seed=11)
    ctx = [1, 9, 41, 150]
    out, ref = run_decode(cache, ctx, 9, torch.float32, seed=12, window=window, num_splits=splits, softcap=cap,
                          q_std=3.0)
    check(out, ref, torch.float32, f"softcap {cap}")
    plain, _ = run_decode(cache, ctx, 9, torch.float32, seed=12, window=window, num_splits=splits, q_std=3.0)
    assert float((plain.double().cpu() - ref).abs().max()) > 1e-3


@pytest.mark.parametrize("cap,window", [(2.0, None), (1.0, 9)])
@needs_triton
def test_prefill_softcap(mode, cap, window):
    """Prompts and chunks on cached context (masked and unmasked key steps), capped scores."""
    cache = Cache(40, 16, 2, 32, torch.float32, seed=13)
    out, ref = run_prefill(cache, [70, 20, 5], [30, 20, 1], 4, torch.float32, seed=14, window=window, softcap=cap,
                           q_std=3.0)
    check(out, ref, torch.float32, f"softcap {cap}")
    plain, _ = run_prefill(cache, [70, 20, 5], [30, 20, 1], 4, torch.float32, seed=14, window=window, q_std=3.0)
    assert float((plain.double().cpu() - ref).abs().max()) > 1e-3


@needs_triton
def test_softcap_bfloat16_and_tanh_accuracy(mode):
    """bfloat16 queries and cache with a cap; and the kernel's tanh (exp2 form, Taylor series
    below 1/8) across its branch point: caps 1e3 .. 1e-2 put the scores on both sides."""
    cache = Cache(16, 16, 3, 64, torch.bfloat16, seed=15)
    out, ref = run_decode(cache, [1, 20, 90], 9, torch.bfloat16, seed=16, num_splits=2, softcap=2.0, q_std=3.0)
    check(out, ref, torch.bfloat16)
    cache = Cache(16, 16, 1, 64, torch.float32, seed=17)
    for cap in (1e3, 10.0, 0.3, 1e-2):
        out, ref = run_decode(cache, [3, 33, 64], 4, torch.float32, seed=18, softcap=cap)
        check(out, ref, torch.float32, f"softcap {cap}")


@needs_triton
def test_softcap_refused_unless_positive_and_finite(mode):
    cache = Cache(8, 16, 1, 64, torch.float32, seed=19)
    for cap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number"):
            run_decode(cache, [3], 4, torch.float32, seed=1, softcap=cap)
        with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number"):
            run_prefill(cache, [3], [3], 4, torch.float32, seed=1, softcap=cap)


# ---- the compiled kernels, without a GPU: ahead-of-time compilation to CUDA binaries -------------

def _compile(launch, capability, tmp_path):
    """Compile one launch as Triton would at run time: the same argument specialization (ints
    equal to 1 become constants, multiples of 16 and aligned pointers get divisibility hints);
    no register spills (triton_checks.compile_to_cubin)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    fn = ta_kernels._kernels()[launch.kernel]
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, launch.args)):
        ty, attr = native_specialize_impl(CUDABackend, arg, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = attr
        elif attr:
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    signature.update({name: "constexpr" for name in launch.constexprs})
    return compile_to_cubin(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), capability,
                            launch.options, tmp_path, launch.kernel)


# (Hq, Hk, head_dim, block_size, query dtype, cache dtype, window): SmolLM2, a Llama-3-8B-like
# GQA layer with a window, MHA with head_dim 80 and blocks of 8, fp8 caches, float32.
COMPILE_CASES = [
    (9, 3, 64, 16, torch.bfloat16, torch.bfloat16, None),
    (32, 8, 128, 16, torch.float16, torch.float16, 4096),
    (4, 4, 80, 8, torch.bfloat16, torch.bfloat16, None),
    (32, 8, 128, 32, torch.bfloat16, torch.float8_e4m3fn, None),
    (9, 3, 64, 16, torch.float16, torch.float8_e5m2, 256),
    (4, 1, 96, 128, torch.float32, torch.float32, None),
]


@needs_ptxas
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("head_dim,q_dtype", [(256, torch.bfloat16), (128, torch.float16)])
@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_softcap_compiles_to_cuda_binary(monkeypatch, tmp_path, capability, head_dim, q_dtype):
    """The SOFTCAP variants compile for sm_80 / sm_90 without register spills, at Gemma 2 9B's
    attention (16 query / 8 KV heads of 256, window 4096, cap 50) and at head_dim 128
    (Gemma 2 27B); the capped decode keeps its tensor-core dot."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_compile_cache()))
    Hq, Hk, B, T, S, W = 16, 8, 16, 256, 8, 64
    cache = torch.empty(2, 32, B, Hk, head_dim, dtype=q_dtype)
    scales = torch.ones(Hk)
    q = torch.empty(S, Hq, head_dim, dtype=q_dtype)
    tables, lens = torch.zeros(S, W, dtype=torch.int32), torch.ones(S, dtype=torch.int32)
    launches = ta._decode_launches(q, cache[0], cache[1], tables, lens, 0.0625, 4096, False, scales, scales, 1,
                                   torch.empty_like(q), 50.0)
    qp = torch.empty(T, Hq, head_dim, dtype=q_dtype)
    launches.append(ta._prefill_launch(qp, cache[0], cache[1], tables[:2], torch.zeros(3, dtype=torch.int32),
                                       lens[:2], 0.0625, T, 4096, False, scales, scales, torch.empty_like(qp),
                                       capability=divmod(capability, 10), logits_soft_cap=50.0))
    assert all(launch.constexprs["SOFTCAP"] for launch in launches)
    for launch in launches:
        ptx = _compile(launch, capability, tmp_path)
        if launch.kernel == "decode":
            assert "mma.sync" in ptx


@needs_ptxas
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-b{c[3]}-{str(c[5])[6:]}")
@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_compiles_to_cuda_binary(monkeypatch, tmp_path, capability, case):
    """What the interpreter cannot show: Triton's compiler accepts every kernel (types, dot
    shapes, layouts) and ptxas assembles it for sm_80 / sm_90 without register spills, with
    the wrappers' own launch arguments and tiles. On sm_90 the 16-bit prefill dots are wgmma
    (Hopper tensor cores), decode's are mma; the fp8 store is one float32 -> fp8
    round-to-nearest-even saturating conversion after an IEEE division."""
    Hq, Hk, D, B, q_dtype, cache_dtype, window = case
    if cache_dtype == torch.float8_e4m3fn and capability < 89:
        pytest.skip("Triton has no fp8e4nv before sm_89 (the wrappers refuse it there: test_e4m3_refused_before_sm89)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_compile_cache()))
    cache = torch.empty(2, 32, B, Hk, D, dtype=cache_dtype)
    fp8 = cache_dtype in FP8
    scales = torch.ones(Hk)
    S, W, T = 8, 64, 512
    q = torch.empty(S, Hq, D, dtype=q_dtype)
    tables, lens = torch.zeros(S, W, dtype=torch.int32), torch.ones(S, dtype=torch.int32)
    launches = ta._decode_launches(q, cache[0], cache[1], tables, lens, 0.1, window, fp8, scales, scales, 1,
                                   torch.empty_like(q))
    launches += ta._decode_launches(q, cache[0], cache[1], tables, lens, 0.1, window, fp8, scales, scales, 8,
                                    torch.empty_like(q))
    qkv = torch.empty(T, (Hq + 2 * Hk) * D, dtype=q_dtype)  # prefill's query and the written K/V: fused views
    qp = qkv[:, : Hq * D].view(T, Hq, D)
    k, v = qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D), qkv[:, (Hq + Hk) * D:].view(T, Hk, D)
    launches.append(ta._prefill_launch(qp, cache[0], cache[1], tables[:2], torch.zeros(3, dtype=torch.int32),
                                       lens[:2], 0.1, T, window, fp8, scales, scales, torch.empty_like(qp),
                                       capability=divmod(capability, 10)))
    launches.append(ta._write_launch(k, v, cache[0], cache[1], torch.zeros(T, dtype=torch.int64), fp8, scales,
                                     scales))
    assert [launch.kernel for launch in launches] == ["decode", "decode", "reduce", "prefill", "write"]
    for launch in launches:
        ptx = _compile(launch, capability, tmp_path)
        sixteen_bit = q_dtype != torch.float32
        if launch.kernel == "prefill" and sixteen_bit:
            assert ("wgmma.mma_async" if capability >= 90 else "mma.sync") in ptx
        if launch.kernel == "decode" and sixteen_bit:
            assert "mma.sync" in ptx
        if launch.kernel == "write" and fp8:
            assert "div.rn.f32" in ptx
            if capability >= 90:
                kind = "e4m3" if cache_dtype == torch.float8_e4m3fn else "e5m2"
                assert f"cvt.rn.satfinite.{kind}x2.f32" in ptx
