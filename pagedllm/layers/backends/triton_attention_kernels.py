"""The Triton kernels of paged attention (the KV write, decode with its split-K reduce, varlen
prefill) and how they are jitted; their wrappers, which check arguments and build launches, are
layers/backends/triton_attention.py. Apart from the wrappers because the kernels are device code
with their own rules (core builtins only, jitted per mode over their own globals).

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

import types
from typing import NamedTuple

from pagedllm import envs

try:  # optional: the CPU install has no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None


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
