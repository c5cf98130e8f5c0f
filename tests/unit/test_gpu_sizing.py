"""The GPU path's arithmetic without a GPU: KV cache sizing from profiled figures and its errors,
the CUDA-graph buckets, the padded decode buffers, dtype and attention-backend choice."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.backends import TorchPagedAttentionBackend, select_attn_backend
from pagedllm.worker.cuda_graphs import capture_sizes
from pagedllm.worker.device import resolve_dtype
from pagedllm.worker.memory_sizing import MemoryProfile, size_kv_cache
from pagedllm.worker.padded_decode import StaticDecodeInputs, bucket_for

GIB = 1 << 30


def _profile(**kw) -> MemoryProfile:
    base = dict(total=80 * GIB, weights=14 * GIB, peak_activations=2 * GIB, cuda_graphs=GIB // 2,
                non_torch=GIB // 2)
    base.update(kw)
    return MemoryProfile(**base)


def test_blocks_are_what_is_left_of_the_utilized_memory():
    per_block = 2 * 1024 * 1024  # a 7B model's block of 16 tokens in bf16
    sizing = size_kv_cache(_profile(), 0.9, per_block, 16, 4096)
    expected_budget = int(80 * GIB * 0.9) - 14 * GIB - 2 * GIB - GIB // 2 - GIB // 2
    assert sizing.budget_bytes == expected_budget
    assert sizing.num_blocks == expected_budget // per_block
    half = size_kv_cache(_profile(), 0.5, per_block, 16, 4096)
    assert half.num_blocks == (40 * GIB - 17 * GIB) // per_block < sizing.num_blocks


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01, 2.0])
def test_utilization_outside_zero_one_is_refused(utilization):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        size_kv_cache(_profile(), utilization, 1024, 16, 128)


def test_weights_that_do_not_fit_say_what_to_do():
    with pytest.raises(ValueError, match="weights take 70.00 GiB.*Raise gpu_memory_utilization.*quantized.*tensor_parallel_size"):
        size_kv_cache(_profile(weights=70 * GIB), 0.8, 1024, 16, 128)


def test_max_model_len_too_large_names_the_largest_that_fits():
    per_block = 1 << 20
    profile = _profile(total=20 * GIB, weights=15 * GIB, peak_activations=GIB, cuda_graphs=0, non_torch=0)
    # 20 * 0.9 - 16 = 2 GiB -> 2048 blocks of 16 tokens = 32768 tokens
    with pytest.raises(ValueError, match=r"max_model_len=131072.*largest max_model_len that fits is 32768"):
        size_kv_cache(profile, 0.9, per_block, 16, 131072)
    assert size_kv_cache(profile, 0.9, per_block, 16, 32768).num_blocks == 2048


def test_nothing_left_after_activations_is_an_error():
    profile = _profile(total=20 * GIB, weights=15 * GIB, peak_activations=4 * GIB, cuda_graphs=0, non_torch=0)
    with pytest.raises(ValueError, match="No memory is left for the KV cache"):
        size_kv_cache(profile, 0.9, 1 << 20, 16, 1024)


def test_ranks_combine_to_the_worst_figures():
    a = _profile(total=80 * GIB, weights=7 * GIB, peak_activations=GIB)
    b = _profile(total=79 * GIB, weights=6 * GIB, peak_activations=2 * GIB)
    w = MemoryProfile.worst([a, b])
    assert (w.total, w.weights, w.peak_activations) == (79 * GIB, 7 * GIB, 2 * GIB)


@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]),
    (3, [1, 2, 3]),
    (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_default_capture_sizes(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_cap_and_configured():
    sizes = capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and all(b % 8 == 0 for b in sizes[3:])
    assert capture_sizes(256, [32, 1, 4, 300]) == [1, 4, 32]  # above max_num_seqs: never used
    assert bucket_for([1, 2, 4, 8], 3) == 4 and bucket_for([1, 2, 4, 8], 9) is None


def test_static_inputs_pad_onto_the_scratch_block():
    buf = StaticDecodeInputs(max_batch=4, table_width=5, block_size=8, scratch_block=99, device=torch.device("cpu"))
    ids, pos, slots, tables, ctx = buf.fill(
        torch.tensor([5, 6, 7]), torch.tensor([10, 20, 30]), torch.tensor([80, 161, 242]),
        torch.tensor([[10, 11], [20, 21], [30, 31]]), torch.tensor([11, 21, 31]), bucket=4)
    assert ids.tolist() == [5, 6, 7, 0] and slots.tolist() == [80, 161, 242, 99 * 8]
    assert ctx.tolist() == [11, 21, 31, 1] and tables[3, 0] == 99 and tables[:3, :2].tolist() == [[10, 11], [20, 21], [30, 31]]
    # A smaller step after it: the rows it no longer uses are padding again (no stale context).
    ids, _, slots, tables, ctx = buf.fill(torch.tensor([1]), torch.tensor([3]), torch.tensor([3]),
                                          torch.tensor([[7]]), torch.tensor([4]), bucket=2)
    assert ids.tolist() == [1, 0] and ctx.tolist() == [4, 1] and tables[1, 0] == 99 and slots[1] == 99 * 8
    with pytest.raises(ValueError, match="does not fit bucket"):
        buf.fill(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                 torch.zeros(1, 6, dtype=torch.long), torch.ones(1, dtype=torch.long), bucket=1)


def test_auto_dtype_on_gpus_with_and_without_bfloat16():
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, bf16_supported=True) is torch.bfloat16
    assert resolve_dtype("auto", cuda, bf16_supported=False) is torch.float16
    assert resolve_dtype("float16", cuda, bf16_supported=True) is torch.float16
    with pytest.raises(ValueError, match="bfloat16.*not supported by this GPU.*float16"):
        resolve_dtype("bfloat16", cuda, bf16_supported=False)
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


def test_attention_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert select_attn_backend("auto", cpu, torch.float32) is TorchPagedAttentionBackend
    assert select_attn_backend("torch", torch.device("cuda"), torch.bfloat16) is TorchPagedAttentionBackend
    # int8 blocks carry their scales inside: the torch backend's, on a GPU too
    assert select_attn_backend("auto", torch.device("cuda"), torch.int8) is TorchPagedAttentionBackend
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_attn_backend("flashinfer", cpu, torch.float32)
    from pagedllm.layers.backends import triton_attention_kernels

    if not triton_attention_kernels.HAS_TRITON:
        with pytest.raises(ValueError, match="needs the triton package"):
            select_attn_backend("triton", cpu, torch.float32)
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_attn_backend("triton", cpu, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attn_backend("triton", cpu, torch.float32).name == "triton"
    with pytest.raises(ValueError, match="does not read kv_cache_dtype torch.int8"):
        select_attn_backend("triton", cpu, torch.int8)
    cuda = torch.device("cuda")
    assert select_attn_backend("auto", cuda, torch.bfloat16).name == "triton"
    # fp8: Triton's conversions need sm_89+; below, auto takes the torch backend and triton refuses
    assert select_attn_backend("auto", cuda, torch.float8_e4m3fn, capability=(9, 0)).name == "triton"
    assert select_attn_backend("auto", cuda, torch.float8_e4m3fn, capability=(8, 0)) is TorchPagedAttentionBackend
    with pytest.raises(ValueError, match=r"compute capability 8.9 or more.*this one is \(8, 0\)"):
        select_attn_backend("triton", cuda, torch.float8_e5m2, capability=(8, 0))
