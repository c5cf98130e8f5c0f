"""The Triton dequantize-fused int4 / int8 matmul (quantization/triton_int_gemm.py) against
plain-torch dequantize-then-matmul (packing.dequantize).

Without a GPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, set per test with
monkeypatch: Triton reads it when `triton.jit` runs, and the module jits its kernel on first use
per mode, so the variable need not be set before `import triton`). The interpreter executes the
kernel's own code (loads with masks, shifts, group indexing, the K loop, split-K) with numpy; it
does not compile it, so the `gpu` tests run the compiled kernel on CUDA.

Tolerance. Float32: every product (code - zero) * scale is exact in float32, so the kernel and the
reference differ only in how float32 sums of K products are ordered. Each output is checked
against a float64 product of the same weight with the classic bound for a sum of K rounded
products, |y - y64| <= (K + 2) * 2**-24 * (|x| @ |W|), and the max error relative to the
largest output against torch's own float32 matmul must stay <= 1e-5 (K <= 256 here: the bound
is at most ~1.5e-5 of |x| @ |W| and random signs make it ~1e-7 in practice). Float16 /
bfloat16: the weight tile is rounded to x's dtype as the torch path does, the products are exact
in the float32 accumulator, and the output is rounded once, so the bound gains half an ulp of
the output's dtype.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.quantization.kernels import triton_int_gemm as tig
from pagedllm.quantization.formats.packing import dequantize, pack_int32
from tests.unit.triton_checks import assert_needs_triton_without_it, compile_to_cubin, needs_ptxas
from tests.triton_cache import triton_compile_cache

needs_triton = pytest.mark.skipif(not tig.HAS_TRITON, reason="triton is not installed (pip install triton): "
                                  "the kernel cannot run, not even in Triton's CPU interpreter")
U32 = 2.0 ** -24
REL = 1e-5


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_weight(K, N, bits, gs, seed, scale_dtype=torch.float16, device="cpu"):
    """Canonical-form tensors with random codes, zeros over the full code range, signed scales."""
    g = torch.Generator().manual_seed(seed)
    groups = K // (K if gs == -1 else gs)
    codes = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 1 << bits, (groups, N), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = ((torch.rand(groups, N, generator=g) - 0.3) * 0.05).to(scale_dtype)
    return (pack_int32(codes, bits, 0).to(device), scales.to(device), zeros.to(device))


def make_perm(K, seed, device="cpu"):
    return torch.randperm(K, generator=torch.Generator().manual_seed(seed)).to(device)


def check(y, x, qweight, scales, zeros, bits, gs, perm=None, truncating=False):
    """y against float64 (elementwise bound) and torch float32 dequantize-then-matmul (relative).
    `truncating`: Triton's interpreter converts float32 to bfloat16 by truncation (the GPU rounds
    to nearest even, as torch does), so the weight and the output may each be a full bfloat16 ulp
    off instead of half a one."""
    K = x.shape[-1]
    w = dequantize(qweight, scales, zeros, bits, K if gs == -1 else gs)  # float32 [K, N], exact
    xp = x if perm is None else x.index_select(-1, perm)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[1])
    wx = w.to(x.dtype)  # what the torch path multiplies (rounded for float16 / bfloat16)
    ref64 = xp.double() @ wx.double()
    bound = (K + 2) * U32 * (xp.double().abs() @ wx.double().abs())
    if x.dtype != torch.float32:
        eps = torch.finfo(x.dtype).eps
        bound = bound + ref64.abs() * (eps if truncating else eps / 2) * 1.01
        if truncating:
            bound = bound + eps * (xp.double().abs() @ w.double().abs())
    err = (y.double() - ref64).abs()
    worst = float((err - bound).max())
    assert worst <= 1e-30, f"max excess over the rounding bound {worst:.3g} (max error {float(err.max()):.3g})"
    if x.dtype == torch.float32:
        ref = torch.matmul(xp, w)
        rel = float((y - ref).abs().max() / ref.abs().max())
        assert rel <= REL, rel


# ---- interpreter (CPU) ---------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, -1])
@pytest.mark.parametrize("K,N", [(128, 64), (192, 96)])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_matches_reference_float32(interpret, M, K, N, gs, bits, act_order):
    seed = M * 1000 + K + N + bits + gs
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed)
    perm = make_perm(K, seed) if act_order else None
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1))
    y = tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs, perm)
    check(y, x, qweight, scales, zeros, bits, gs, perm)


@needs_triton
@pytest.mark.parametrize("x_dtype,scale_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.bfloat16), (torch.float32, torch.float32),
                                                 (torch.float32, torch.bfloat16)])
def test_dtypes(interpret, x_dtype, scale_dtype):
    K, N, gs, bits = 128, 64, 32, 4
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed=3, scale_dtype=scale_dtype)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4)).to(x_dtype)
    y = tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs)
    check(y, x, qweight, scales, zeros, bits, gs, truncating=x_dtype == torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_k(interpret, split_k, x_dtype):
    """Partial sums over K ranges (the decode configuration on a GPU); 5 > the 4 K tiles."""
    K, N, gs, bits = 256, 64, 64, 4
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed=split_k)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(9)).to(x_dtype)
    perm = make_perm(K, 11)
    y = tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs, perm, block_k=64, split_k=split_k)
    check(y, x, qweight, scales, zeros, bits, gs, perm, truncating=x_dtype == torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("K,gs,block_k,bits", [(128, 32, 64, 4),   # groups narrower than the tile
                                               (96, 8, None, 4),    # a group size not a multiple of 16
                                               (256, 128, None, 8),
                                               (200, -1, None, 8),  # K not a multiple of the tile
                                               (96, 48, 32, 4)])    # groups not aligned with tiles
def test_group_layouts(interpret, K, gs, block_k, bits):
    N = 48  # not a multiple of BLOCK_N
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed=K + gs)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1))
    y = tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs, block_k=block_k)
    check(y, x, qweight, scales, zeros, bits, gs)


@needs_triton
def test_leading_dims_strides_and_empty(interpret):
    K, N, gs, bits = 128, 64, 64, 8
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed=2)
    x = torch.randn(2, 3, K)
    check(tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs), x, qweight, scales, zeros, bits, gs)
    xt = torch.randn(K, 5).t()  # [5, K], column-major
    check(tig.int_gemm_triton(xt, qweight, scales, zeros, bits, gs), xt, qweight, scales, zeros, bits, gs)
    y = tig.int_gemm_triton(torch.empty(0, K), qweight, scales, zeros, bits, gs)
    assert y.shape == (0, N)


@needs_triton
def test_bad_perm_reads_nothing_out_of_bounds(interpret):
    """Out-of-range perm entries are masked (read as zero), never dereferenced."""
    K, N, gs, bits = 64, 32, 32, 4
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed=5)
    x = torch.randn(2, K)
    perm = torch.arange(K)
    perm[3] = 10 ** 9
    y = tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs, perm)
    w = dequantize(qweight, scales, zeros, bits, gs)
    xp = x.index_select(-1, torch.arange(K))
    xp[:, 3] = 0
    torch.testing.assert_close(y, xp @ w, rtol=1e-5, atol=1e-5)


@needs_triton
def test_layer_glue(interpret):
    """`apply_packed_int` (what `apply` runs on CUDA) hands the layer's canonical tensors, its
    method's bits / group size and perm to the kernel and adds the bias; it declines (None) a
    layer without `qweight` (another compute form)."""
    K, N, gs, bits = 128, 64, 32, 4
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed=8)
    layer = SimpleNamespace(qweight=qweight, scales=scales, zeros=zeros, perm=make_perm(K, 8))
    method = SimpleNamespace(bits=bits, group_size=gs)
    x, bias = torch.randn(2, 3, K), torch.randn(N)
    y = tig.apply_packed_int(method, layer, x, bias)
    ref = x.index_select(-1, layer.perm) @ dequantize(qweight, scales, zeros, bits, gs) + bias
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert tig.apply_packed_int(method, SimpleNamespace(int_weight=object()), x, bias) is None


def test_cpu_apply_never_uses_triton(monkeypatch):
    """CPU tensors take the portable path: the Triton module is not even consulted."""
    from pagedllm.layers.linear import Linear
    from pagedllm.quantization.formats.gptq import GPTQConfig

    monkeypatch.setattr(tig, "apply_packed_int", lambda *a: pytest.fail("Triton path taken on CPU"))
    cfg = GPTQConfig.from_config({"bits": 8, "group_size": -1, "sym": True, "checkpoint_format": "gptq_v2"})
    layer = Linear(32, 8, quant_method=cfg.get_linear_method("m.o", ["m.o"]))
    layer.load_weight("qweight", pack_int32(torch.randint(0, 256, (32, 8), dtype=torch.int32), 8, 0))
    layer.load_weight("qzeros", pack_int32(torch.full((1, 8), 128, dtype=torch.int32), 8, 1))
    layer.load_weight("scales", torch.full((1, 8), 0.01, dtype=torch.float16))
    layer.process_weights_after_loading()
    assert layer(torch.randn(2, 32)).shape == (2, 8)


# ---- checks and the optional import --------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("change,match", [
    (dict(bits=2), "bits must be 4 or 8"),
    (dict(x=torch.randn(2, 64, dtype=torch.float64)), "x has dtype torch.float64"),
    (dict(x=torch.randn(2, 96)), r"x has 96 inputs .* holds 64 \(8 4-bit codes per int32 word\)"),
    (dict(qweight=torch.zeros(8, 16, dtype=torch.int64)), "qweight must be a 2-D int32 tensor"),
    (dict(group_size=48), "group_size 48 must be -1 or a positive divisor of the input size 64"),
    (dict(group_size=0), "group_size 0 must be"),
    (dict(scales=torch.ones(2, 16, dtype=torch.float16)), r"scales must be \[4, 16\]"),
    (dict(scales=torch.ones(4, 16, dtype=torch.float64)), "scales must be .* got torch.float64"),
    (dict(zeros=torch.zeros(4, 16, dtype=torch.int32)), r"zeros must be uint8 \[4, 16\]"),
    (dict(perm=torch.arange(63)), r"perm must be None or an int64 / int32 tensor \[64\]"),
    (dict(perm=torch.arange(64).float()), "perm must be"),
    (dict(block_m=24), "block_m must be a power of two >= 16, got 24"),
    (dict(split_k=0), "split_k must be >= 1, got 0"),
])
def test_input_errors(interpret, change, match):
    args = dict(x=torch.randn(2, 64), qweight=torch.zeros(8, 16, dtype=torch.int32),
                scales=torch.ones(4, 16, dtype=torch.float16), zeros=torch.zeros(4, 16, dtype=torch.uint8),
                bits=4, group_size=16, perm=None)
    kw = {k: change.pop(k) for k in ("block_m", "split_k") if k in change}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        tig.int_gemm_triton(**args, **kw)


@needs_triton
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qweight, scales, zeros = make_weight(64, 16, 4, 16, seed=0)
    with pytest.raises(ValueError, match="tensors on cpu need TRITON_INTERPRET=1"):
        tig.int_gemm_triton(torch.randn(2, 64), qweight, scales, zeros, 4, 16)


@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_imports_without_triton():
    """With triton unimportable the module still imports; the function says what is missing and
    the layer hook declines (the caller keeps the torch path)."""
    assert_needs_triton_without_it(
        "pagedllm.quantization.kernels.triton_int_gemm", "t.int_gemm_triton(None, None, None, None, 4, -1)",
        checks="import torch\nassert t.apply_packed_int(None, None, torch.zeros(1), None) is None\n")


# ---- the compiled kernel (CUDA) ------------------------------------------------------------------

@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,gs,act_order", [(4, 128, False), (4, 128, True), (4, 32, False), (8, -1, False),
                                               (8, 64, True)])
@pytest.mark.parametrize("M", [1, 7, 16, 100, 256])
def test_compiled_kernel_on_cuda(monkeypatch, M, bits, gs, act_order, x_dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    K, N = 1024, 768
    qweight, scales, zeros = make_weight(K, N, bits, gs, seed=M + bits, device="cuda")
    perm = make_perm(K, M, device="cuda") if act_order else None
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to("cuda", x_dtype)
    y = tig.int_gemm_triton(x, qweight, scales, zeros, bits, gs, perm)
    torch.cuda.synchronize()
    check(y, x, qweight, scales, zeros, bits, gs, perm)


@pytest.mark.gpu
@needs_triton
def test_cuda_layer_dispatches_to_triton(monkeypatch):
    """A quantized layer on CUDA runs the kernel (not the portable path) and equals that path."""
    from pagedllm.layers.linear import Linear
    from pagedllm.quantization.formats.gptq import GPTQConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    K, N, gs = 512, 256, 128
    cfg = GPTQConfig.from_config({"bits": 4, "group_size": gs, "sym": True, "checkpoint_format": "gptq_v2"})
    method = cfg.get_linear_method("m.o", ["m.o"])
    layer = Linear(K, N, bias=True, dtype=torch.float16, device="cuda", quant_method=method)
    qweight, scales, zeros = make_weight(K, N, 4, gs, seed=1)
    layer.load_weight("qweight", qweight)
    layer.load_weight("qzeros", pack_int32(zeros.to(torch.int32), 4, 1))
    layer.load_weight("scales", scales)
    layer.load_weight("bias", torch.randn(N).half())
    layer.process_weights_after_loading()
    assert layer.qweight.is_cuda
    calls = []
    real = tig.int_gemm_triton
    monkeypatch.setattr(tig, "int_gemm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(4, K, device="cuda", dtype=torch.float16)
    y = layer(x)
    assert calls == [1]
    w = dequantize(layer.qweight, layer.scales, layer.zeros, 4, gs).to(torch.float16)
    torch.testing.assert_close(y, x @ w + layer.bias, rtol=2e-3, atol=2e-3)


# ---- the compiled kernel, without a GPU: ahead-of-time compilation to CUDA binaries -------------

_TT = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


@needs_ptxas
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.slow  # compiles each kernel for sm_80 / sm_90: ~1 s a case
@pytest.mark.parametrize("M,K,N,bits,gs,x_dtype,act_order,split", [
    (1, 4096, 4096, 4, 128, torch.float16, False, 8),    # decode: split-K into float32 partials
    (256, 4096, 4096, 8, 128, torch.bfloat16, True, 1),  # prefill tile 128 x 128 x 64, 8 warps
    (17, 576, 1536, 4, 32, torch.float32, False, 1),     # float32, IEEE dot
    (16, 96, 64, 4, 8, torch.float16, False, 1),         # per-row groups
])
def test_compiles_to_cuda_binary(monkeypatch, tmp_path, capability, M, K, N, bits, gs, x_dtype, act_order, split):
    """What the interpreter cannot show: Triton's real compiler accepts the kernel (types, dot
    shapes, layouts) and ptxas assembles it for sm_80 / sm_90, with no register spills, in the
    configurations the wrapper picks. Nothing runs: no GPU needed."""
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_compile_cache()))
    fn = tig._kernel()
    cfg = tig._pick_config(M, N, K, gs, torch.device("cpu"))
    constexprs = tig._constexprs(cfg, bits, x_dtype, act_order)
    pointers = {"x_ptr": _TT[x_dtype], "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
                "perm_ptr": "*i64" if act_order else "*i32",
                "y_ptr": "*fp32" if split > 1 else _TT[x_dtype]}
    signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in fn.arg_names}
    compile_to_cubin(ASTSource(fn, signature, constexprs=constexprs), capability,
                     {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}, tmp_path, "int_gemm")
