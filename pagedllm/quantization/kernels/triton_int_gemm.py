"""The GPU path of the weight-only int4 / int8 grouped layers: a Triton matmul `y = x @ W` that
reads W in pagedllm's canonical packed form (packing.py) and dequantizes it in registers.

One program computes a `[BLOCK_M, BLOCK_N]` tile of `y`, looping over `BLOCK_K` rows of the
input dimension: it loads the int32 words holding those rows (word `k // pf`, the code at bits
`bits * (k % pf)`: the same word is read by the `pf` rows it holds, from cache), takes the codes
with a shift and a mask, subtracts the group's zero points, multiplies by the group's scales in
float32 (exact: a small integer times a 16-bit float), and accumulates `tl.dot` in float32.
The act-order permutation, if any, is a gather of `x`'s columns in the same loads (no copy of
`x`). Float32 activations use IEEE float32 products (no TF32), so the result equals
dequantize-then-matmul to float32 rounding; float16 / bfloat16 activations multiply the
dequantized tile rounded to their dtype, as `torch.matmul(x, dequantize(...).to(x.dtype))` does.
For few rows (decode) the input dimension is split over `split_k` programs whose float32
partial sums are added afterwards in a fixed order (deterministic, no atomics).

Triton is optional: this module imports without it (`HAS_TRITON` False, `int_gemm_triton`
raises), and pagedllm never imports it on CPU (`PackedIntLinearMethod.apply` comes here for
CUDA tensors only). With `TRITON_INTERPRET=1` in the environment when the kernel is first
called, the kernel runs in Triton's interpreter on CPU tensors (the tests); the mode is read
per call, so a compiled and an interpreted kernel can live in one process.
"""

from __future__ import annotations


import torch

from pagedllm import envs

try:  # optional: the CPU install has no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

HAS_TRITON = triton is not None

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if HAS_TRITON:

    def _int_gemm_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, y_ptr,
        M, N, K, group_size, k_tiles_per_split,
        stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
        stride_ys, stride_ym, stride_yn,
        BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_ALIGNED: tl.constexpr, HAS_PERM: tl.constexpr, X_FLOAT32: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        PF: tl.constexpr = 32 // BITS
        CODE_MASK: tl.constexpr = (1 << BITS) - 1
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        arange_k = tl.arange(0, BLOCK_K)

        # core builtins only (tl.full, not tl.zeros / tl.cdiv: Triton's standard library is jitted
        # when triton is imported, so it is interpretable only if TRITON_INTERPRET was set before)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        k_tiles = (K + BLOCK_K - 1) // BLOCK_K
        t_begin = pid_k * k_tiles_per_split
        t_end = tl.minimum(t_begin + k_tiles_per_split, k_tiles)
        for t in range(t_begin, t_end):
            offs_k = t * BLOCK_K + arange_k
            k_mask = offs_k < K
            if HAS_PERM:
                cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
                a_k_mask = k_mask & (cols >= 0) & (cols < K)  # a bad perm never reads out of bounds
            else:
                cols = offs_k
                a_k_mask = k_mask
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
                        mask=m_mask[:, None] & a_k_mask[None, :], other=0.0)

            kn_mask = k_mask[:, None] & n_mask[None, :]
            words = tl.load(qw_ptr + (offs_k // PF)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                            mask=kn_mask, other=0)
            codes = (words >> ((offs_k % PF) * BITS)[:, None]) & CODE_MASK  # int32 [BLOCK_K, BLOCK_N]

            if GROUP_ALIGNED:  # the whole tile lies in one group: one row of scales and zeros
                g = (t * BLOCK_K) // group_size
                s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
                z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=n_mask, other=0)
                w = (codes - z.to(tl.int32)[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]
            else:  # groups narrower than a tile, or not aligned with it: per-row group index
                g = offs_k // group_size
                s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                            mask=kn_mask, other=0.0)
                z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                            mask=kn_mask, other=0)
                w = (codes - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)

            if X_FLOAT32:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            elif UPCAST_DOT:  # interpreter only: its tl.dot multiplies bfloat16 operands' raw bits
                acc = tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.to(a.dtype), acc)

        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

_KERNELS: dict[bool, object] = {}


def _kernel():
    """The jitted kernel for the current mode (compiled, or the interpreter's), made on first use:
    Triton decides between the two when `triton.jit` runs."""
    mode = envs.TRITON_INTERPRET
    k = _KERNELS.get(mode)
    if k is None:
        k = _KERNELS[mode] = triton.jit(_int_gemm_kernel)
    return k


def _pick_block_k(group_size: int, K: int) -> tuple[int, bool]:
    """(BLOCK_K, whether every tile lies in one group)."""
    if group_size == K:
        return (128 if K >= 128 else max(16, triton.next_power_of_2(K))), True
    for bk in (128, 64, 32, 16):
        if group_size % bk == 0:
            return bk, True
    return 32, False  # a group size that is not a multiple of 16 (e.g. 8): per-row groups


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _pick_config(M: int, N: int, K: int, group_size: int, device: torch.device) -> dict:
    block_k, aligned = _pick_block_k(group_size, K)
    if M <= 16:
        block_m, block_n, warps = 16, 64, 4
    elif M <= 32:
        block_m, block_n, warps = 32, 64, 4
    elif M <= 64:
        block_m, block_n, warps = 64, 64, 4
    else:
        block_m, block_n, warps = 128, 128, 8
        if aligned and block_k == 128:
            block_k = 64  # keeps the [BLOCK_K, BLOCK_N] dequantized tile within registers
    split_k = 1
    if device.type == "cuda":
        sms = _num_sms(device)
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        k_tiles = triton.cdiv(K, block_k)
        while tiles * split_k < 2 * sms and split_k * 2 <= k_tiles and split_k < 16:
            split_k *= 2
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps,
                num_stages=3, group_aligned=aligned)


def _constexprs(cfg: dict, bits: int, x_dtype: torch.dtype, has_perm: bool) -> dict:
    """The kernel's compile-time arguments for a configuration of `_pick_config`."""
    return dict(BITS=bits, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                GROUP_ALIGNED=cfg["group_aligned"], HAS_PERM=has_perm, X_FLOAT32=x_dtype == torch.float32,
                # the interpreter's bfloat16 tl.dot is wrong; the same products upcast are exact in float32
                UPCAST_DOT=x_dtype == torch.bfloat16 and envs.TRITON_INTERPRET)


def _check(x, qweight, scales, zeros, bits, group_size, perm) -> tuple[int, int, int]:
    """(K, N, effective group size) of valid inputs; a ValueError naming what is wrong otherwise."""
    if bits not in (4, 8):
        raise ValueError(f"int_gemm_triton: bits must be 4 or 8, got {bits}")
    pf = 32 // bits
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"int_gemm_triton: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"int_gemm_triton: x has dtype {x.dtype}, expected one of {list(_X_DTYPES)}")
    if x.dim() < 1:
        raise ValueError("int_gemm_triton: x must have at least one dimension (its last is the input)")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"int_gemm_triton: qweight must be a 2-D int32 tensor [in/{pf}, out], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    K, N = qweight.shape[0] * pf, qweight.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"int_gemm_triton: x has {x.shape[-1]} inputs in its last dimension, but qweight "
                         f"{tuple(qweight.shape)} holds {K} ({pf} {bits}-bit codes per int32 word)")
    if group_size == -1:
        gs = K
    elif isinstance(group_size, int) and group_size > 0 and K % group_size == 0:
        gs = group_size
    else:
        raise ValueError(f"int_gemm_triton: group_size {group_size} must be -1 or a positive divisor of "
                         f"the input size {K}")
    groups = K // gs
    if scales.dtype not in _SCALE_DTYPES or tuple(scales.shape) != (groups, N):
        raise ValueError(f"int_gemm_triton: scales must be [{groups}, {N}] (groups, out) of float16 / "
                         f"bfloat16 / float32, got {scales.dtype} {tuple(scales.shape)}")
    if zeros.dtype != torch.uint8 or tuple(zeros.shape) != (groups, N):
        raise ValueError(f"int_gemm_triton: zeros must be uint8 [{groups}, {N}] (groups, out), got "
                         f"{zeros.dtype} {tuple(zeros.shape)}")
    tensors = [("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)]
    if perm is not None:
        if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int64, torch.int32) \
                or tuple(perm.shape) != (K,):
            raise ValueError(f"int_gemm_triton: perm must be None or an int64 / int32 tensor [{K}], got "
                             f"{getattr(perm, 'dtype', type(perm).__name__)} {tuple(getattr(perm, 'shape', ()))}")
        tensors.append(("perm", perm))
    devices = {t.device for _, t in tensors}
    if len(devices) != 1:
        raise ValueError("int_gemm_triton: all tensors must be on one device, got "
                         + ", ".join(f"{n} on {t.device}" for n, t in tensors))
    device = x.device
    if device.type != "cuda" and not envs.TRITON_INTERPRET:
        raise ValueError(f"int_gemm_triton: tensors on {device} need TRITON_INTERPRET=1 (Triton's CPU "
                         "interpreter); the compiled kernel runs on CUDA tensors")
    return K, N, gs


def int_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bits: int, group_size: int, perm: torch.Tensor | None = None, *,
                    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                    split_k: int | None = None) -> torch.Tensor:
    """`x @ W` for the canonical packed `W` (packing.py): `x [..., in]` float16 / bfloat16 / float32,
    `qweight` int32 `[in/pf, out]`, `scales [groups, out]`, `zeros` uint8 `[groups, out]`,
    `perm` int64 `[in]` or None (act-order: the product reads `x[..., perm]`). Returns
    `[..., out]` in x's dtype. The block sizes and `split_k` override the heuristic (tests,
    tuning); BLOCK_M / BLOCK_N / BLOCK_K must be powers of two >= 16."""
    if not HAS_TRITON:
        raise RuntimeError("int_gemm_triton needs the triton package (pip install triton); it is not "
                           "installed, and CPU inference does not use it")
    K, N, gs = _check(x, qweight, scales, zeros, bits, group_size, perm)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0 or N == 0:
        return x.new_zeros(*lead, N)
    cfg = _pick_config(M, N, K, gs, x.device)
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if v is not None:
            if v < 16 or v & (v - 1):
                raise ValueError(f"int_gemm_triton: {name} must be a power of two >= 16, got {v}")
            cfg[name] = v
    if block_k is not None:
        cfg["group_aligned"] = gs % block_k == 0 or gs == K
    if split_k is not None:
        if split_k < 1:
            raise ValueError(f"int_gemm_triton: split_k must be >= 1, got {split_k}")
        cfg["split_k"] = split_k
    k_tiles = triton.cdiv(K, cfg["block_k"])
    split = min(cfg["split_k"], k_tiles)
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)  # no split without tiles
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, cfg["block_m"]), triton.cdiv(N, cfg["block_n"]), split)
    _kernel()[grid](
        x2, qweight, scales, zeros, perm if perm is not None else qweight, out,
        M, N, K, gs, per_split,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), zeros.stride(0), zeros.stride(1),
        out.stride(0) if split > 1 else 0, out.stride(-2), out.stride(-1),
        **_constexprs(cfg, bits, x.dtype, perm is not None), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split > 1:
        torch.sum(out, dim=0, out=y) if x.dtype == torch.float32 else y.copy_(out.sum(dim=0))
    return y.view(*lead, N)


def apply_packed_int(method, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`PackedIntLinearMethod.apply` on CUDA: the kernel's output (plus bias), or None where Triton
    is not installed or the layer does not hold the canonical tensors (`qweight`, `scales`,
    `zeros`, `perm`): the caller then takes its other paths."""
    if not HAS_TRITON or getattr(layer, "qweight", None) is None:
        return None
    out = int_gemm_triton(x, layer.qweight, layer.scales, layer.zeros, method.bits, method.group_size,
                          layer.perm)
    return out if bias is None else out + bias
