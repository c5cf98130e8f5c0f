"""Triton paged attention for the CUDA path: the KV-cache write, decode (flash-decoding) and
varlen prefill over the paged cache (`[num_blocks, block_size, kv_heads, head_dim]` per half,
layers/kv_cache_dtype.py), in float32 / bfloat16 / float16 or fp8 (e4m3fn, e5m2) with a
float32 scale per KV head.

Kernel design (all accumulate in float32; the output is in the query's dtype):

- `write_kv_cache`: one program per token row, a `[kv_heads, head_dim]` tile (one contiguous
  cache row of `kv_heads * head_dim` elements). A negative slot masks the whole row (padding).
  fp8: `clamp(x / scale, -fmax, fmax)` (IEEE division), converted round-to-nearest-even.
- `paged_decode_attention`: grid `(seqs, kv_heads, num_splits)`. A program holds the `G = Hq/Hk`
  query heads of its KV head as the rows of one `[BLOCK_G, head_dim]` tile (`BLOCK_G` = G
  padded to >= 16, tl.dot's minimum; the padded rows are zeros and never stored), so each K/V
  page is loaded once for the whole group. It walks `BLOCK_N` tokens per step: the block id of
  every token is gathered from the block table (a page may be smaller or larger than a step,
  block ids in any order), and the `[BLOCK_N, head_dim]` K and V tiles are loaded row by row
  (each row is head_dim contiguous elements: coalesced). Scores `tl.dot(q, k^T)` and `tl.dot(p,
  v)` use the query's dtype (IEEE float32 for float32 queries) with float32 accumulation, in an
  online (exp2) softmax. Split-K: the sequence's visible tiles (window-limited) are divided into
  `num_splits` equal runs computed on the device from its context length; each program writes
  its partial max / sum / unnormalized accumulator to a float32 workspace, and a reduce kernel
  (grid `(seqs, q_heads)`) rescales and sums them. A split without tiles writes the neutral
  partial (max -inf, sum 0); split 0 always has one, as every context holds the current token.
- `paged_prefill_attention`: grid `(query tiles, seqs, kv_heads)`. A tile is `BLOCK_M` rows =
  `BLOCK_M // G` query tokens x the G heads of one KV head (row r: token r // G, head r % G),
  again one K/V load per group. Keys run from the tile's first visible position (window) to
  its last query's position, `BLOCK_N` tokens per step, gathered through the block table as in
  decode. The bottom-right causal mask (query i of a sequence sits at `ctx - qlen + i`) and the
  window are applied per element only in the steps that need them (a step every query of the
  tile sees wholly, most of a long prompt's, skips the mask), with a -inf-safe online softmax
  (a row may see nothing in a step). Every key and value comes from the cache, so a prompt run
  whole, in chunks or after a prefix-cache hit sees the same numbers.
- Logit soft-capping (Gemma 2's `attn_logit_softcapping`, constexpr `SOFTCAP`: the uncapped
  kernels are unchanged): each scaled score s becomes `cap * tanh(s / cap)` before the mask and
  the softmax, as transformers does. tanh comes from exp2 (`(1 - e) / (1 + e)`, e = 2^(-2|x|
  log2 e), no overflow), from its Taylor series below |x| = 1/8 where that form would lose
  digits (relative error about 1e-7 either way); libdevice's tanh would not run in the
  interpreter.
- fp8 caches: the K/V tiles are converted exactly to the dot dtype (every e4m3 / e5m2 value is
  a bfloat16 / float16 value), and the program's one KV-head scale multiplies the scores (k)
  and the accumulator (v) in float32.

CUDA-graph capture: no function here reads a device value on the host (no .item(), no
.tolist()); grids and every kernel constant come from shapes and host ints (`max_query_len`),
`num_splits` defaults to a function of `(seqs, kv_heads, block-table width, block size, SM
count)`; context lengths, block ids and slots are read by the kernels only, and the workspace
is allocated with torch.empty (the graph's pool during capture). Triton compiles a kernel on
its first launch for each specialization (dtypes, tiles, `num_splits == 1` or not, strides
divisible by 16): run every captured shape once before capturing, as graph runners do anyway.

Triton is optional (`HAS_TRITON`); nothing imports this module on CPU inference. With
`TRITON_INTERPRET=1` when a kernel is first called, it runs in Triton's interpreter on CPU
tensors (the tests); kernels are jitted per mode, as quantization/triton_int_gemm.py
does, and so is the key sweep decode and prefill share (the device function `_attend_keys`,
which each mode's kernels call as their own: `_kernels`). The kernels use core builtins only
(`tl.reduce` with the standard combine functions, not `tl.max` / `tl.sum` / `tl.zeros`:
Triton's standard library is jitted at import, so it is interpretable only if
TRITON_INTERPRET was set before that). The interpreter's bfloat16 tl.dot
multiplies raw bits, so there the dots of bfloat16 queries run on float32-upcast operands.
"""

from __future__ import annotations

import math
import types
from typing import NamedTuple

import torch

from pagedllm import envs

try:  # optional: the CPU install has no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_CACHE_DTYPES = (*_FLOAT_DTYPES, *_FP8_MAX)
_LOG2E = 1.4426950408889634
_DEFAULT_SMS = 16  # off CUDA (the interpreter): a small fixed "device" for the split heuristic
_MIN_SPLIT_TOKENS = 256  # fewer keys per split than this do not pay for the reduce pass
_MAX_SPLITS = 64


if HAS_TRITON:

    def _write_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
        num_kv_heads,
        stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
        stride_kcn, stride_kcb, stride_kch, stride_kcd, stride_vcn, stride_vcb, stride_vch, stride_vcd,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        blk = slot // PAGE
        off = slot % PAGE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :] & (slot >= 0)
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                    mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                    mask=mask, other=0.0)
        if FP8:
            ks = tl.load(ks_ptr + offs_h, mask=offs_h < num_kv_heads, other=1.0)
            vs = tl.load(vs_ptr + offs_h, mask=offs_h < num_kv_heads, other=1.0)
            k = tl.math.div_rn(k.to(tl.float32), ks[:, None])
            v = tl.math.div_rn(v.to(tl.float32), vs[:, None])
            k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
            v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
        kc = kc_ptr + blk * stride_kcn + off * stride_kcb + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
        vc = vc_ptr + blk * stride_vcn + off * stride_vcb + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)

    def _attend_keys(
        q, seq, kvh, t_begin, t_end, lo, hi, scale_log2, k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr,
        stride_kn, stride_kb, stride_kh, stride_kd, stride_vn, stride_vb, stride_vh, stride_vd, stride_bts, stride_btw,
        offs_d, d_mask, qpos, window, all_lo, first_pos, softcap_log2,
        ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, FP8: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """The key sweep of decode and prefill (inlined into both): the query rows `q` ([ROWS,
        BLOCK_D], of KV head `kvh`) over key steps `t_begin .. t_end - 1` of block-table row `seq`,
        BLOCK_N keys a step (those in [lo, hi) valid), gathered through the table, in an online
        softmax -> `(m_i, l_i, acc)`: each row's max and sum of exp2 scores, and its unnormalized
        accumulator (fp8: times the KV head's v scale). CAUSAL (prefill): row r sees only keys <=
        qpos[r] (and, with a window, > qpos[r] - window), masked per element unless every row
        sees the whole step (its keys in [all_lo, first_pos]), and the max is -inf-safe (a row
        may see nothing in a step); else (decode) only invalid keys are masked: every step holds
        a visible key, so every row's max is finite (padded rows score 0). SOFTCAP: the scaled
        scores are soft-capped first (`softcap_log2` = cap * log2 e, the cap in exp2 units)."""
        if FP8:
            qk_scale = scale_log2 * tl.load(ks_ptr + kvh)
        else:
            qk_scale = scale_log2
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        l_i = tl.full((ROWS,), 0.0, tl.float32)
        acc = tl.full((ROWS, BLOCK_D), 0.0, tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        arange_n = tl.arange(0, BLOCK_N)
        for t in range(t_begin, t_end):
            tok = t * BLOCK_N + arange_n
            valid = (tok < hi) & (tok >= lo)
            blk = tl.load(bt_row + (tok // PAGE) * stride_btw, mask=valid, other=0).to(tl.int64)
            off = tok % PAGE
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_base + blk[:, None] * stride_kn + off[:, None] * stride_kb + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)
            v = tl.load(v_base + blk[:, None] * stride_vn + off[:, None] * stride_vb + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)
            if DOT_DTYPE == tl.float32:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
            if SOFTCAP:  # cap * tanh(s / cap) of the scaled score s, in exp2 units
                x = qk * (qk_scale / softcap_log2)
                ax = tl.where(x < 0.0, -x, x)
                e = tl.math.exp2(ax * -2.8853900817779268)  # exp(-2|x|)
                x2 = ax * ax
                th = tl.where(ax < 0.125, ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0)))),
                              (1.0 - e) / (1.0 + e))
                qk = tl.where(x < 0.0, -th, th) * softcap_log2
            else:
                qk = qk * qk_scale
            if CAUSAL:
                if (t * BLOCK_N < all_lo) | (t * BLOCK_N + BLOCK_N - 1 > first_pos):
                    visible = valid[None, :] & (tok[None, :] <= qpos[:, None])
                    if HAS_WINDOW:
                        visible = visible & (tok[None, :] > qpos[:, None] - window)
                    qk = tl.where(visible, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            else:
                qk = tl.where(valid[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
                m_safe = m_new
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            if DOT_DTYPE == tl.float32:
                acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None])
            m_i = m_new
        if FP8:
            acc = acc * tl.load(vs_ptr + kvh)
        return m_i, l_i, acc

    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, ks_ptr, vs_ptr, o_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
        scale_log2, window, num_splits, softcap_log2,
        stride_qs, stride_qh, stride_qd,
        stride_kn, stride_kb, stride_kh, stride_kd, stride_vn, stride_vb, stride_vh, stride_vd,
        stride_bts, stride_btw, stride_os, stride_oh, stride_od,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        num_heads = tl.num_programs(1) * G
        ctx = tl.load(ctx_ptr + s).to(tl.int32)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_mask = offs_g < G
        d_mask = offs_d < HEAD_DIM
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

        if HAS_WINDOW:  # the query sits at ctx - 1 and sees keys ctx - window .. ctx - 1
            lo = tl.maximum(ctx - window, 0)
        else:
            lo = ctx * 0
        tile_lo = lo // BLOCK_N
        tile_hi = (ctx + BLOCK_N - 1) // BLOCK_N
        per_split = (tile_hi - tile_lo + num_splits - 1) // num_splits
        t_begin = tile_lo + sp * per_split
        t_end = tl.minimum(t_begin + per_split, tile_hi)

        m_i, l_i, acc = _attend_keys(
            q, s, kvh, t_begin, t_end, lo, ctx, scale_log2, k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr,
            stride_kn, stride_kb, stride_kh, stride_kd, stride_vn, stride_vb, stride_vh, stride_vd, stride_bts,
            stride_btw, offs_d, d_mask, ctx, window, lo, ctx, softcap_log2, ROWS=BLOCK_G, BLOCK_D=BLOCK_D,
            BLOCK_N=BLOCK_N, PAGE=PAGE, DOT_DTYPE=DOT_DTYPE, FP8=FP8, CAUSAL=False, HAS_WINDOW=HAS_WINDOW,
            SOFTCAP=SOFTCAP)
        out_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:  # partials [S, Hq, num_splits] (m, l) and [S, Hq, num_splits, HEAD_DIM] (acc)
            row = (s * num_heads + heads).to(tl.int64) * num_splits + sp
            tl.store(ws_m_ptr + row, m_i, mask=g_mask)
            tl.store(ws_l_ptr + row, l_i, mask=g_mask)
            tl.store(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        else:
            out = acc / l_i[:, None]
            tl.store(o_ptr + s.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                     out.to(o_ptr.dtype.element_ty), mask=out_mask)

    def _decode_reduce_kernel(
        ws_m_ptr, ws_l_ptr, ws_acc_ptr, o_ptr, num_splits,
        stride_os, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        s = tl.program_id(0)
        h = tl.program_id(1)
        num_heads = tl.num_programs(1)
        offs_sp = tl.arange(0, BLOCK_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        sp_mask = offs_sp < num_splits
        d_mask = offs_d < HEAD_DIM
        row = (s * num_heads + h).to(tl.int64) * num_splits + offs_sp
        m = tl.load(ws_m_ptr + row, mask=sp_mask, other=float("-inf"))
        l = tl.load(ws_l_ptr + row, mask=sp_mask, other=0.0)
        acc = tl.load(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
        m_max = tl.reduce(m, 0, tl.standard._elementwise_max)  # finite: split 0 is never empty
        w = tl.math.exp2(m - m_max)  # 0 for empty splits (m = -inf)
        denom = tl.reduce(w * l, 0, tl.standard._sum_combine)
        out = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine) / denom
        tl.store(o_ptr + s.to(tl.int64) * stride_os + h * stride_oh + offs_d * stride_od,
                 out.to(o_ptr.dtype.element_ty), mask=d_mask)

    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, ctx_ptr, ks_ptr, vs_ptr, o_ptr,
        scale_log2, window, softcap_log2,
        stride_qt, stride_qh, stride_qd,
        stride_kn, stride_kb, stride_kh, stride_kd, stride_vn, stride_vb, stride_vh, stride_vd,
        stride_bts, stride_btw, stride_ot, stride_oh, stride_od,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        tile = tl.program_id(0)
        p_id = tl.program_id(1)
        kvh = tl.program_id(2)
        q_start = tl.load(qsl_ptr + p_id).to(tl.int32)
        q_len = tl.load(qsl_ptr + p_id + 1).to(tl.int32) - q_start
        ctx = tl.load(ctx_ptr + p_id).to(tl.int32)
        first_q = tile * BLOCK_Q

        rows = tl.arange(0, BLOCK_M)
        qi = first_q + rows // G
        heads = kvh * G + rows % G
        row_mask = (rows < BLOCK_Q * G) & (qi < q_len)
        qpos = ctx - q_len + qi  # bottom-right causal: the last query sits at ctx - 1
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q_rows = (q_start + qi).to(tl.int64) * stride_qt + heads * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

        hi = ctx - q_len + tl.minimum(first_q + BLOCK_Q, q_len)  # one past the tile's last query
        if HAS_WINDOW:
            lo = tl.maximum(ctx - q_len + first_q - window + 1, 0)
        else:
            lo = ctx * 0
        tile_lo = lo // BLOCK_N
        tile_hi = tl.where(first_q < q_len, (hi + BLOCK_N - 1) // BLOCK_N, tile_lo)  # past the queries: none
        # keys every query of the tile sees: a step wholly inside needs no mask (most steps of a long prompt)
        first_pos = ctx - q_len + first_q
        if HAS_WINDOW:
            all_lo = hi - window  # the last query's first visible key
        else:
            all_lo = lo

        m_i, l_i, acc = _attend_keys(
            q, p_id, kvh, tile_lo, tile_hi, lo, hi, scale_log2, k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr,
            stride_kn, stride_kb, stride_kh, stride_kd, stride_vn, stride_vb, stride_vh, stride_vd, stride_bts,
            stride_btw, offs_d, d_mask, qpos, window, all_lo, first_pos, softcap_log2, ROWS=BLOCK_M,
            BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, PAGE=PAGE, DOT_DTYPE=DOT_DTYPE, FP8=FP8, CAUSAL=True,
            HAS_WINDOW=HAS_WINDOW, SOFTCAP=SOFTCAP)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_rows = (q_start + qi).to(tl.int64) * stride_ot + heads * stride_oh
        tl.store(o_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])


_KERNELS: dict[bool, dict[str, object]] = {}


def _kernels() -> dict[str, object]:
    """The jitted kernels for the current mode (compiled, or the interpreter's), made on first
    use: Triton decides between the two when `triton.jit` runs.

    The device function `_attend_keys` is jitted per mode too, as neither mode can call the
    other's (a compiled kernel refuses an interpreted function, an interpreted kernel cannot
    call a JITFunction). A kernel finds a function it calls by name in its `__globals__` (the
    compiler when it compiles, the interpreter when it runs), so each mode's kernels are copies
    of the module's functions over their own globals, where `_attend_keys` is that mode's."""
    mode = envs.TRITON_INTERPRET
    ks = _KERNELS.get(mode)
    if ks is None:
        scope = dict(globals())

        def jit(fn):
            copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
            copy.__annotations__, copy.__qualname__, copy.__doc__ = fn.__annotations__, fn.__qualname__, fn.__doc__
            return triton.jit(copy)

        scope["_attend_keys"] = jit(_attend_keys)
        ks = _KERNELS[mode] = {
            "write": jit(_write_kv_kernel),
            "decode": jit(_decode_kernel),
            "reduce": jit(_decode_reduce_kernel),
            "prefill": jit(_prefill_kernel),
        }
    return ks


class _Launch(NamedTuple):
    """One kernel launch as the wrappers build it: run by `_run`, or compiled ahead of time by
    the tests with the same arguments (so the checked binary is the one a launch would build)."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    options: dict


def _run(launch: _Launch) -> None:
    _kernels()[launch.kernel][launch.grid](*launch.args, **launch.constexprs, **launch.options)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


_SMS: dict[int, int] = {}
_CAPS: dict[int, tuple[int, int]] = {}


def _num_sms(device: torch.device) -> int:
    """The device's SM count (132 on an H200), cached; a fixed default off CUDA."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def default_num_splits(num_seqs: int, num_kv_heads: int, table_width: int, block_size: int,
                       device: torch.device) -> int:
    """Splits per (sequence, KV head) from shapes only (CUDA-graph safe): enough programs for
    about two waves over the SMs, but no split shorter than `_MIN_SPLIT_TOKENS` of the
    block table's capacity, and 1 when the batch alone fills the device."""
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * _num_sms(device) // programs)
    by_len = max(1, (table_width * block_size) // _MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, _MAX_SPLITS))


def _dot_dtype(q_dtype: torch.dtype):
    """The dots' operand type: the query's (IEEE float32 for float32); in the interpreter float32
    for bfloat16 too (its bfloat16 tl.dot multiplies raw bits; the upcast products are exact)."""
    if q_dtype == torch.float32 or (q_dtype == torch.bfloat16 and envs.TRITON_INTERPRET):
        return tl.float32
    return tl.bfloat16 if q_dtype == torch.bfloat16 else tl.float16


def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, cached; Hopper's (9, 0) off CUDA (the interpreter
    takes the configuration the H200 gets)."""
    if device.type != "cuda":
        return (9, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPS:
        _CAPS[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPS[index]


def _decode_config(head_dim: int, group: int, q_dtype: torch.dtype) -> dict:
    """Tile sizes of the decode kernel: `BLOCK_N` keys a step (64, or 32 where the tiles are
    wide: float32 or head_dim > 128), 4 warps, 2 stages (the K/V loads of the next step in
    flight while this one computes)."""
    block_d = max(16, _next_pow2(head_dim))
    block_n = 32 if block_d > 128 or q_dtype == torch.float32 else 64
    return dict(BLOCK_G=max(16, _next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4, num_stages=2)


def _prefill_config(max_query_len: int, head_dim: int, group: int, q_dtype: torch.dtype,
                    capability: tuple[int, int]) -> dict:
    """Tile sizes of the prefill kernel: `BLOCK_M` rows (query tokens x group heads) up to 128
    with 8 warps on Hopper (wgmma), 64 rows where registers are tighter (pre-Hopper mma,
    float32, head_dim > 128), fewer for short prompts; `BLOCK_N` 64 keys a step (32 wide)."""
    block_d = max(16, _next_pow2(head_dim))
    wide = block_d > 128 or q_dtype == torch.float32
    cap = 64 if wide or capability < (9, 0) else 128
    block_m = min(cap, max(16, _next_pow2(max(1, max_query_len) * group)))
    block_m = max(block_m, _next_pow2(group))  # at least one query token a tile
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_D=block_d, BLOCK_N=32 if wide else 64,
                num_warps=8 if block_m >= 128 else 4, num_stages=2)


def _need_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs the triton package (pip install triton); it is not installed, and "
                           "CPU inference does not use it")


def _check_device(name: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError(f"{name}: tensors on {device} need TRITON_INTERPRET=1 (Triton's CPU interpreter); the "
                         "compiled kernels run on CUDA tensors")


def _check_cache(name: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"{name}: key_cache and value_cache must both be [num_blocks, block_size, kv_heads, "
                         f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype not in _CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"{name}: cache dtype must be one of {list(_CACHE_DTYPES)} (both halves alike), got "
                         f"{key_cache.dtype} / {value_cache.dtype}")


def _scales(name: str, cache_dtype: torch.dtype, k_scale, v_scale, num_kv_heads: int, like: torch.Tensor):
    """(fp8?, k_scale, v_scale) as kernel arguments: fp8 caches need float32 [Hk] scales; float
    caches hold their values themselves (scales, if passed, are not used)."""
    if cache_dtype not in _FP8_MAX:
        return False, like, like
    if cache_dtype == torch.float8_e4m3fn and _capability(like.device) < (8, 9):
        raise ValueError(f"{name}: a float8_e4m3fn KV cache needs a GPU of compute capability >= 8.9 (Triton "
                         f"has no e4m3fn type before Ada / Hopper), this one is "
                         f"{'.'.join(map(str, _capability(like.device)))}; use float8_e5m2")
    for what, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or tuple(sc.shape) != (num_kv_heads,):
            raise ValueError(f"{name}: a {cache_dtype} cache needs {what} as a float32 tensor [{num_kv_heads}] "
                             f"(one scale per KV head), got {getattr(sc, 'dtype', type(sc).__name__)} "
                             f"{tuple(getattr(sc, 'shape', ()))}")
    return True, k_scale.contiguous(), v_scale.contiguous()


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Store `key / value [T, Hk, D]` (any strides) at the flat slots `slot_mapping [T]`
    (`block * block_size + offset`; negative: skip the row) of `key_cache / value_cache [N, B,
    Hk, D]`: cast to a float cache, or `clamp(x / scale, -fmax, fmax)` rounded to an fp8 one."""
    _need_triton("write_kv_cache")
    name = "write_kv_cache"
    _check_cache(name, key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    want = (key.shape[0], num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != want or tuple(value.shape) != want:
        raise ValueError(f"{name}: key {tuple(key.shape)} and value {tuple(value.shape)} must be [T, {num_kv_heads}, "
                         f"{head_dim}] for the cache {tuple(key_cache.shape)}")
    if key.dtype not in _FLOAT_DTYPES or value.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: key / value must be float32, bfloat16 or float16, got {key.dtype} / {value.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(f"{name}: slot_mapping must be int32 / int64 [{key.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    _check_device(name, key, value, key_cache, value_cache, slot_mapping)
    fp8, ks, vs = _scales(name, key_cache.dtype, k_scale, v_scale, num_kv_heads, slot_mapping)
    if key.shape[0] == 0:
        return
    _run(_write_launch(key, value, key_cache, value_cache, slot_mapping, fp8, ks, vs))


def _write_launch(key, value, key_cache, value_cache, slot_mapping, fp8, ks, vs) -> _Launch:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    return _Launch("write", (key.shape[0],), (
        key, value, key_cache, value_cache, slot_mapping, ks, vs,
        num_kv_heads, *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
    ), dict(HEAD_DIM=head_dim, PAGE=block_size, BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim),
            FP8=fp8, FP8_MAX=_FP8_MAX.get(key_cache.dtype, 0.0)), dict(num_warps=4, num_stages=1))


def _check_attention(name: str, query, key_cache, value_cache, block_tables, context_lens, num_rows, out):
    _check_cache(name, key_cache, value_cache)
    if query.dim() != 3 or query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: query must be a float32 / bfloat16 / float16 tensor [tokens, heads, head_dim], "
                         f"got {query.dtype} {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"{name}: query head_dim {head_dim} != the cache's head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: {num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_rows or block_tables.dtype not in (torch.int32,
                                                                                                  torch.int64):
        raise ValueError(f"{name}: block_tables must be int32 / int64 [{num_rows}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if tuple(context_lens.shape) != (num_rows,) or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: context_lens must be int32 / int64 [{num_rows}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if out is not None and (tuple(out.shape) != tuple(query.shape) or out.dtype not in _FLOAT_DTYPES):
        raise ValueError(f"{name}: out must be a float tensor of the query's shape {tuple(query.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")


def _window(sliding_window: int | None) -> tuple[bool, int]:
    if sliding_window is None or sliding_window <= 0:
        return False, 0
    return True, int(sliding_window)


def _softcap(name: str, logits_soft_cap: float | None) -> tuple[bool, float]:
    """(SOFTCAP, cap * log2 e) for the kernels; None or 0: no capping. ValueError unless the cap
    is a positive finite number."""
    if not logits_soft_cap:
        return False, 0.0
    if not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
        raise ValueError(f"{name}: logits_soft_cap must be a positive finite number (or None), got {logits_soft_cap!r}")
    return True, float(logits_soft_cap) * _LOG2E


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """One query token per sequence, `query [S, Hq, D]`, over the first `context_lens[s]` (>= 1)
    cached positions of block-table row `s` -> `[S, Hq, D]` in query's dtype (or `out`).
    `num_splits`: programs per (sequence, KV head) over its keys (None: `default_num_splits`);
    the result does not depend on it beyond float32 rounding. `logits_soft_cap`: each scaled
    score s becomes `cap * tanh(s / cap)` (None: not). Capture-safe (module docstring)."""
    _need_triton("paged_decode_attention")
    name = "paged_decode_attention"
    num_seqs = query.shape[0] if query.dim() == 3 else -1
    _check_attention(name, query, key_cache, value_cache, block_tables, context_lens, num_seqs, out)
    tensors = [query, key_cache, value_cache, block_tables, context_lens] + ([out] if out is not None else [])
    _check_device(name, *tensors)
    _softcap(name, logits_soft_cap)
    _, block_size, num_kv_heads, _ = key_cache.shape
    fp8, ks, vs = _scales(name, key_cache.dtype, k_scale, v_scale, num_kv_heads, context_lens)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, block_tables.shape[1], block_size, query.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{name}: num_splits must be a positive int, got {num_splits!r}")
    for launch in _decode_launches(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window,
                                   fp8, ks, vs, num_splits, out, logits_soft_cap):
        _run(launch)
    return out


def _decode_launches(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window, fp8, ks, vs,
                     num_splits, out, logits_soft_cap: float | None = None) -> list[_Launch]:
    """The decode kernel's launch, and the reduce kernel's when split (workspace allocated here)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    has_window, window = _window(sliding_window)
    softcap, softcap_log2 = _softcap("paged_decode_attention", logits_soft_cap)
    cfg = _decode_config(head_dim, group, query.dtype)
    split = num_splits > 1
    if split:
        ws_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    else:
        ws_m = ws_l = ws_acc = out
    launches = [_Launch("decode", (num_seqs, num_kv_heads, num_splits), (
        query, key_cache, value_cache, block_tables, context_lens, ks, vs, out, ws_m, ws_l, ws_acc,
        scale * _LOG2E, window, num_splits, softcap_log2,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
    ), dict(G=group, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"],
            BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=has_window, FP8=fp8, SPLIT=split, DOT_DTYPE=_dot_dtype(query.dtype),
            SOFTCAP=softcap),
        dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))]
    if split:
        launches.append(_Launch("reduce", (num_seqs, num_heads), (ws_m, ws_l, ws_acc, out, num_splits, *out.stride()),
                                dict(HEAD_DIM=head_dim, BLOCK_SPLITS=_next_pow2(num_splits), BLOCK_D=cfg["BLOCK_D"]),
                                dict(num_warps=4, num_stages=1)))
    return launches


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_query_len: int, sliding_window: int | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Varlen prefill over the cache: `query [T, Hq, D]` holds P sequences' new tokens back to
    back (`query_start_loc [P + 1]`), whose K/V are already in the cache; sequence p has
    `context_lens[p]` positions (cached + new) in block-table row p, and its query i sits at
    `ctx - qlen + i` (bottom-right causal, minus the window). `max_query_len` (host int, >= every
    qlen) sizes the grid. `logits_soft_cap`: the scores capped as in decode (None: not). Returns
    `[T, Hq, D]` in query's dtype (or writes `out`)."""
    _need_triton("paged_prefill_attention")
    name = "paged_prefill_attention"
    num_prefills = context_lens.shape[0] if context_lens.dim() == 1 else -1
    _check_attention(name, query, key_cache, value_cache, block_tables, context_lens, num_prefills, out)
    if tuple(query_start_loc.shape) != (num_prefills + 1,) or query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: query_start_loc must be int32 / int64 [{num_prefills + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{name}: max_query_len must be a host int >= 0, got {max_query_len!r}")
    tensors = [query, key_cache, value_cache, block_tables, query_start_loc, context_lens]
    _check_device(name, *tensors, *([out] if out is not None else []))
    _softcap(name, logits_soft_cap)
    num_kv_heads = key_cache.shape[2]
    fp8, ks, vs = _scales(name, key_cache.dtype, k_scale, v_scale, num_kv_heads, context_lens)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_prefills == 0 or query.shape[0] == 0 or max_query_len == 0:
        return out
    _run(_prefill_launch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                         max_query_len, sliding_window, fp8, ks, vs, out, logits_soft_cap=logits_soft_cap))
    return out


def _prefill_launch(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, max_query_len,
                    sliding_window, fp8, ks, vs, out, capability: tuple[int, int] | None = None,
                    logits_soft_cap: float | None = None) -> _Launch:
    """The prefill kernel's launch; `capability` (default: the device's) picks the tiles."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    has_window, window = _window(sliding_window)
    softcap, softcap_log2 = _softcap("paged_prefill_attention", logits_soft_cap)
    cfg = _prefill_config(max_query_len, head_dim, group, query.dtype, capability or _capability(query.device))
    grid = (-(-max_query_len // cfg["BLOCK_Q"]), context_lens.shape[0], num_kv_heads)
    return _Launch("prefill", grid, (
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, ks, vs, out,
        scale * _LOG2E, window, softcap_log2,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
    ), dict(G=group, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=cfg["BLOCK_Q"],
            BLOCK_D=cfg["BLOCK_D"], BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=has_window, FP8=fp8,
            DOT_DTYPE=_dot_dtype(query.dtype), SOFTCAP=softcap), dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
