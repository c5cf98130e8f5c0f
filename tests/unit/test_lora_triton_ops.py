"""The Triton LoRA kernels (lora/triton_ops.py) in Triton's CPU interpreter (`TRITON_INTERPRET=1`,
set per test: the module jits its kernels per mode on first use) against the float64 oracle of
test_lora_ops.py, on small shapes; and compiled (not run) to CUDA binaries where triton's NVIDIA
backend is installed. The interpreter runs the kernels' own code (segment lookup, gathers
through the order, masks, the K loop, tl.dot); the `gpu` tests run them compiled."""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora import ops
from pagedllm.lora import triton_ops as tops
from tests.unit.test_lora_ops import assert_within, make_indices, make_stack, oracle_expand, oracle_shrink
from tests.unit.triton_checks import assert_needs_triton_without_it, compile_to_cubin, needs_ptxas
from tests.triton_cache import triton_compile_cache

needs_triton = pytest.mark.skipif(not tops.HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _case(T, K, sizes, max_rank, pattern, seed, S=3, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n, N = len(sizes), sum(sizes)
    a = make_stack(S, None, n, max_rank, K, [max_rank, max_rank - 3], g, 1)
    b = make_stack(S, N, n, max_rank, None, [max_rank, max_rank - 3], g, 2)
    tensors = (torch.randn(T, K, generator=g), a, torch.randn(T, n * max_rank, generator=g), b,
               torch.randn(T, N, generator=g), make_indices(T, S, pattern, g))
    return tuple(t.to(device) for t in tensors)


@needs_triton
@pytest.mark.parametrize("T,K,sizes,max_rank,block_m", [
    (0, 16, [16], 8, None),
    (1, 24, [20], 8, None),
    (5, 40, [16, 8, 8], 12, None),
    (37, 32, [24, 17], 16, 16),  # several tiles per segment, a partial last one
])
@pytest.mark.parametrize("pattern", ["random", "same", "base", "runs"])
def test_interpreted_kernels_match_float64(interpret, T, K, sizes, max_rank, block_m, pattern):
    x, a, buf, b, y, idx = _case(T, K, sizes, max_rank, pattern, seed=T + K)
    out = torch.full((T, a.shape[1]), float("nan"))  # every row written, zeros for slot -1
    tops.lora_shrink_triton(x, a, idx, out, block_m=block_m)
    assert_within(out, *oracle_shrink(x, a, idx))
    want = oracle_expand(buf, b, idx, y, sizes)
    tops.lora_expand_triton(buf, b, idx, y, sizes, block_m=block_m)
    assert_within(y, *want)


@needs_triton
def test_interpreted_expand_on_a_view_touches_only_its_tokens_and_slices(interpret):
    """y a row-strided view inside a NaN guard; base-model rows keep their bits."""
    x, a, buf, b, y, idx = _case(9, 16, [16, 8], 8, "random", seed=1)
    big = torch.full((11, 30), float("nan"))
    view = big[1:10, 3:27]
    view.copy_(y)
    want = oracle_expand(buf, b, idx, y, [16, 8])
    tops.lora_expand_triton(buf, b, idx, view, [16, 8])
    assert_within(view, *want)
    assert int(big.isnan().sum()) == big.numel() - view.numel()
    assert torch.equal(view[idx == -1], y[idx == -1])


@needs_triton
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, a, _, _, _, idx = _case(2, 16, [16], 8, "same", seed=0)
    with pytest.raises(ValueError, match="tensors on cpu need TRITON_INTERPRET=1"):
        tops.lora_shrink_triton(x, a, idx, torch.empty(2, 8))


@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_imports_without_triton():
    assert_needs_triton_without_it("pagedllm.lora.triton_ops",
                                   "t.lora_shrink_triton(torch.zeros(1, 1), None, None, None)", checks="import torch\n")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_public_ops_on_cuda(monkeypatch, T, dtype):
    """The public ops dispatch CUDA tensors to the compiled kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, a, buf, b, y, idx = _case(T, 576, [576, 192, 192], 16, "runs", seed=T, S=4)
    want_out, _ = oracle_shrink(x, a, idx)
    want_y, _ = oracle_expand(buf, b, idx, y, [576, 192, 192])
    cast = [t.to("cuda", dtype) if t.is_floating_point() else t.to("cuda") for t in (x, a, buf, b, y, idx)]
    out = ops.lora_shrink(*cast[:2], cast[5])
    ops.lora_expand(cast[2], cast[3], cast[5], cast[4], [576, 192, 192])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(cast[4].double().cpu(), want_y, rtol=tol, atol=tol * 10)


_TT = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}


@pytest.mark.slow  # compiles for a GPU: ~0.6 s a case
@needs_ptxas
@pytest.mark.parametrize("name", ["shrink", "expand"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiles_to_cuda_binary(monkeypatch, tmp_path, name, dtype):
    """What the interpreter cannot show: Triton's compiler accepts the kernels (the segment
    helper called as a jitted function, dot shapes) and ptxas assembles them for sm_80 without
    spills. Nothing runs: no GPU needed."""
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_compile_cache()))
    fn = tops._kernel(name)
    constexprs = dict(NUM_SEGS=5, BLOCK_M=32, BLOCK_N=64, BLOCK_K=16 if name == "expand" else 64,
                      IEEE=dtype == torch.float32)
    pointers = {"order_ptr": "*i64", "starts_ptr": "*i64", "tile_starts_ptr": "*i64", "tile_seg_ptr": "*i64"}
    signature = {n: pointers.get(n, _TT[dtype] if n.endswith("_ptr") else
                                 "constexpr" if n in constexprs else "i32") for n in fn.arg_names}
    compile_to_cubin(ASTSource(fn, signature, constexprs=constexprs), 80, {"num_warps": 4, "num_stages": 2},
                     tmp_path, f"lora_{name}")
