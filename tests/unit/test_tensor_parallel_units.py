"""Tensor parallelism's pieces that need no process group: the step plan as the other ranks get
it and the scheduler's block-table deltas it forwards, the CPU split, the vocabulary split, the start-up checks, and every weight format's shard
cuts (a rank's layer, loaded from its cuts of the checkpoint tensors, computes exactly its part
of the whole layer's output)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.distributed.cpu_binding import rank_binding
from pagedllm.distributed.sharding import column_shard, row_shard, vocab_shard
from pagedllm.core.step_plan import SequenceStep, StepPlan, decode_from_rank0, encode_for_workers
from pagedllm.engine.step_planner import plan_of
from pagedllm.executor.multiproc import check_tensor_parallel_devices
from pagedllm.layers.linear import Linear
from pagedllm.quantization.formats.awq import AWQConfig
from pagedllm.quantization.formats.compressed_tensors import CompressedTensorsConfig
from pagedllm.quantization.formats.gptq import GPTQConfig
from pagedllm.model.llama import LlamaForCausalLM
from tests.integration.model_fixtures import tiny_config


# ---- the step message ------------------------------------------------------------------------

def _roundtrip(sched_out):
    payload = encode_for_workers(plan_of(sched_out))
    return decode_from_rank0(payload), payload


def test_the_step_message_forwards_the_schedulers_deltas():
    """A real scheduler's steps (admission, a fork, copy-on-write, an abort) through the message
    to a worker's BlockTable: its rows equal the scheduler's tables at every step."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import SequenceState
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_config import SchedulerConfig
    from pagedllm.worker.block_table import BlockTable

    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    worker = BlockTable(2, num_rows=1)
    a = SequenceState(seq_id=0, request_id="a", prompt_token_ids=list(range(10, 16)), arrival_time=0.0)
    b = SequenceState(seq_id=1, request_id="b", prompt_token_ids=list(range(50, 53)), arrival_time=1.0)
    sched.add_sequence(a)
    sched.add_sequence(b)
    for step in range(8):
        out = sched.schedule()
        got, _ = _roundtrip(out)
        assert got.released_seq_ids == out.released_seq_ids
        for seq_id in got.released_seq_ids:
            worker.release(seq_id)
        for s in got.sequences:
            worker.apply(s.seq_id, s.blocks_from, s.new_block_ids)
            assert worker.ids(s.seq_id) == kv.get_block_ids(s.seq_id)
        assert [(s.seq_id, s.token_ids, s.start_pos, s.sample) for s in got.sequences] == \
            [(s.seq.seq_id, s.token_ids, s.start_pos, s.sample) for s in out.scheduled]
        assert [tuple(c) for c in got.block_copies] == [tuple(c) for c in out.block_copies]
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.sample:
                s.seq.append_token(7)
        if step == 1:  # a fork: the child's first write copies the shared last block
            child = SequenceState(seq_id=2, request_id="a", prompt_token_ids=a.prompt_token_ids,
                             arrival_time=0.0, index=1)
            for t in a.output_token_ids:
                child.append_token(t)
            sched.fork_sequence(a, child)
        if step == 4:
            sched.abort_request("b")
    assert worker.num_live == 2  # b released


def test_the_step_message_carries_draft_tokens():
    """Speculative decoding: a worker's runner projects a logits row per draft token like rank
    0's (the vocab-parallel gather needs the same rows on every rank), so the drafts travel."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import SequenceState
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_config import SchedulerConfig

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(num_blocks=16, block_size=4))
    a = SequenceState(seq_id=0, request_id="a", prompt_token_ids=list(range(10, 16)), arrival_time=0.0)
    sched.add_sequence(a)
    sched.update_after_step(sched.schedule())
    a.append_token(7)
    a.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [11, 12, 13]
    got, _ = _roundtrip(out)
    assert got.sequences[0].draft_token_ids == [11, 12, 13]
    assert got.sequences[0].token_ids == [7, 11, 12, 13]


def test_a_decode_step_message_is_small():
    """256 decoding sequences with 64-block tables: a few bytes per sequence, never the tables."""
    # steady decode: the runner holds all 64 ids, none is new
    plan = StepPlan([SequenceStep(i, [5], 1000, 64, [], True) for i in range(256)], 256)
    assert len(encode_for_workers(plan)) < 24 * 256


def test_the_other_ranks_get_the_plan_without_rank_0s_parts():
    """Only rank 0 samples: the sampling rows and the mask future stay home; the rest arrives
    equal, adapters included."""
    from concurrent.futures import Future

    from pagedllm.lora.request import LoRARequest

    lora = LoRARequest("a", 3, "/adapters/a")
    plan = StepPlan([SequenceStep(4, [1, 2], 0, 0, [9], True, lora_int_id=3)], 2, [(1, 2)], [(3, 0)], [],
                    [7], [8], {3: lora}, new_sampling_rows=[object()], token_masks=Future())
    got = decode_from_rank0(encode_for_workers(plan))
    assert got.new_sampling_rows == [] and got.token_masks is None
    assert got.sequences == plan.sequences and got.lora_requests == {3: lora}
    assert [tuple(c) for c in got.block_copies] == [(1, 2)] and got.released_seq_ids == [7]


def test_a_step_plan_cannot_be_changed_once_made():
    plan = StepPlan([SequenceStep(0, [1], 0, 0, [5], True)])
    with pytest.raises(AttributeError):
        plan.token_masks = object()
    with pytest.raises(AttributeError):
        plan.sequences[0].all_logits = True


# ---- cores, vocabulary, start-up checks -------------------------------------------------------

def test_each_rank_gets_its_own_cores():
    assert [rank_binding(r, 2, [0, 1]) for r in range(2)] == [((0,), 1), ((1,), 1)]
    assert [rank_binding(r, 3, list(range(16))).cores for r in range(3)] == \
        [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14)]
    assert [rank_binding(r, 3, [4, 6]) for r in range(3)] == [((4,), 1), ((6,), 1), ((4,), 1)]  # round-robin
    assert rank_binding(1, 2, list(range(8)), num_threads=2) == ((4, 5, 6, 7), 2)


def test_vocab_split_covers_an_uneven_vocabulary():
    parts = [vocab_shard(49153, r, 3) for r in range(3)]
    assert parts == [(0, 16385), (16385, 16385), (32770, 16383)]
    assert sum(n for _, n in parts) == 49153


def test_more_ranks_than_gpus_is_a_startup_error():
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs 4 GPUs, but 2 are visible"):
        check_tensor_parallel_devices("cuda", 4, visible_gpus=2)
    check_tensor_parallel_devices("cuda", 2, visible_gpus=2)
    check_tensor_parallel_devices("cpu", 8)


def test_heads_that_do_not_split_name_the_numbers():
    smollm2_like = tiny_config("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                               intermediate_size=1536)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's 9 attention heads "
                                         r"\(3 KV heads\); it must be one of \[1, 3, 9\]"):
        LlamaForCausalLM.check_tensor_parallel(smollm2_like, 2)
    LlamaForCausalLM.check_tensor_parallel(smollm2_like, 3)
    with pytest.raises(ValueError, match="4 KV heads cannot be replicated evenly over 6"):
        LlamaForCausalLM.check_tensor_parallel(tiny_config("llama", num_attention_heads=12, num_key_value_heads=4,
                                                           hidden_size=96, intermediate_size=120), 6)
    with pytest.raises(ValueError, match="intermediate size of 128 does not divide into 3"):
        LlamaForCausalLM.check_tensor_parallel(tiny_config("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96), 3)


# ---- shard cuts of every weight format --------------------------------------------------------

IN, OUT, WORLD = 128, 96, 2


def _rand_i32(*shape, g):
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int32)


def _gptq_tensors(bits, gs, g, g_idx=None):
    pf, groups = 32 // bits, IN // gs
    t = {"qweight": _rand_i32(IN // pf, OUT, g=g), "qzeros": _rand_i32(groups, OUT // pf, g=g),
         "scales": (torch.rand(groups, OUT, generator=g) * 0.01 + 0.001).half()}
    t["g_idx"] = g_idx if g_idx is not None else (torch.arange(IN, dtype=torch.int32) // gs)
    return t


FORMATS = {
    "gptq-4bit-g32": (lambda: GPTQConfig.from_config({"bits": 4, "group_size": 32}),
                      lambda g: _gptq_tensors(4, 32, g)),
    "gptq-8bit-channel": (lambda: GPTQConfig.from_config({"bits": 8, "group_size": -1}),
                          lambda g: _gptq_tensors(8, IN, g, torch.zeros(IN, dtype=torch.int32))),
    "awq-4bit-g32": (lambda: AWQConfig.from_config({"bits": 4, "group_size": 32}),
                     lambda g: {"qweight": _rand_i32(IN, OUT // 8, g=g), "qzeros": _rand_i32(IN // 32, OUT // 8, g=g),
                                "scales": (torch.rand(IN // 32, OUT, generator=g) * 0.01 + 0.001).half()}),
    "ct-4bit-g32-asym": (
        lambda: CompressedTensorsConfig.from_config({"format": "pack-quantized", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                               "symmetric": False}}}}),
        lambda g: {"weight_packed": _rand_i32(OUT, IN // 8, g=g),
                   "weight_scale": (torch.rand(OUT, IN // 32, generator=g) * 0.01 + 0.001).half(),
                   "weight_zero_point": _rand_i32(OUT // 8, IN // 32, g=g),
                   "weight_shape": torch.tensor([OUT, IN])}),
    "float": (lambda: None, lambda g: {"weight": torch.randn(OUT, IN, generator=g)}),
}


def _layer(quant_config, tensors, shard=None):
    method = quant_config.get_linear_method("layer", ["layer"]) if quant_config is not None else None
    layer = Linear(IN if shard is None or shard.kind == "column" else shard.in_range[1],
                   OUT if shard is None or shard.kind == "row" else shard.out_ranges[0][1],
                   bias=False, quant_method=method, tp_shard=shard)
    for name, t in tensors.items():
        for dim, start, length in layer.checkpoint_slices(name, None, tuple(t.shape)):
            t = t.narrow(dim, start, length)
        layer.load_weight(name, t.contiguous())
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_column_and_row_shards_compute_their_part_of_the_layer(fmt):
    make_config, make_tensors = FORMATS[fmt]
    tensors = make_tensors(torch.Generator().manual_seed(0))
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = _layer(make_config(), tensors)(x)
        partial_sum = torch.zeros_like(full)
        for rank in range(WORLD):
            start, length = rank * OUT // WORLD, OUT // WORLD
            col = _layer(make_config(), tensors, column_shard([OUT], [(start, length)], IN))
            torch.testing.assert_close(col(x), full[:, start:start + length], rtol=1e-5, atol=1e-5)
            row = _layer(make_config(), tensors, row_shard(IN, OUT, rank, WORLD, "the input"))
            lo, n = row.tp_shard.in_range
            partial_sum += row(x[:, lo:lo + n])
    torch.testing.assert_close(partial_sum, full, rtol=1e-4, atol=1e-4)


def test_act_order_shards_whose_groups_stay_whole_load():
    """Act-order groups scattered inside each rank's half of the rows: the row shards load and
    sum to the layer; groups straddling the halves are refused (they would be split)."""
    g = torch.Generator().manual_seed(3)
    gs = 16
    halves = [torch.randperm(IN // 2, generator=g) // gs, torch.randperm(IN // 2, generator=g) // gs + IN // 2 // gs]
    tensors = _gptq_tensors(4, gs, g, torch.cat(halves).to(torch.int32))
    config = lambda: GPTQConfig.from_config({"bits": 4, "group_size": gs, "desc_act": True})  # noqa: E731
    x = torch.randn(3, IN, generator=g)
    with torch.no_grad():
        full = _layer(config(), tensors)(x)
        total = sum(_layer(config(), tensors, row_shard(IN, OUT, r, WORLD, "the input"))(x[:, r * 64:(r + 1) * 64])
                    for r in range(WORLD))
    torch.testing.assert_close(total, full, rtol=1e-4, atol=1e-4)
    tensors["g_idx"] = (torch.randperm(IN, generator=g) // gs).to(torch.int32)
    with pytest.raises(ValueError, match="would split a quantization group: rows 0..63 hold only part"):
        _layer(config(), tensors, row_shard(IN, OUT, 0, WORLD, "the input"))


def test_a_shard_that_splits_a_group_is_refused_at_construction():
    config = GPTQConfig.from_config({"bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match=r"GPTQ layer layer: tensor parallelism would split a quantization group: "
                                         r"the 128 input rows split into shards of 64, not a multiple of group_size 128"):
        Linear(64, OUT, quant_method=config.get_linear_method("layer", ["layer"]),
               tp_shard=row_shard(IN, OUT, 0, 2, "the input"))
    awq = AWQConfig.from_config({"bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="would split the 8 outputs packed in one int32 of qweight"):
        Linear(IN, 4, quant_method=awq.get_linear_method("layer", ["layer"]),
               tp_shard=column_shard([OUT], [(4, 4)], IN))


def test_gguf_cuts_read_only_the_rank_part_of_the_blocks():
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from pagedllm.model.gguf_loader import cut_gguf_data
    from pagedllm.quantization.formats.gguf_block_decoding import dequantize_tensor, gguf_blocks

    w = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        raw = quantize(w, qtype)
        full = dequantize_tensor(raw, qtype).reshape(8, 128)
        data, shape, left = cut_gguf_data(raw, qtype, (8, 128), [(0, 2, 4), (1, 64, 64)])
        assert shape == (4, 64) and left == [] and data.nbytes == raw.nbytes // 4
        assert torch.equal(dequantize_tensor(data, qtype).reshape(shape), full[2:6, 64:])
        assert torch.equal(gguf_blocks(data, qtype, shape).dequantize(), full[2:6, 64:])
    data, shape, left = cut_gguf_data(quantize(w, T.Q8_0), T.Q8_0, (8, 128), [(1, 16, 32)])
    assert shape == (8, 128) and left == [(1, 16, 32)]  # inside a block of 32: cut after dequantizing


def test_ray_placement_knobs_are_checked(monkeypatch):
    from pagedllm.executor.ray_executor import _placement

    monkeypatch.delenv("PAGEDLLM_RAY_PLACEMENT_STRATEGY", raising=False)
    monkeypatch.delenv("PAGEDLLM_RAY_CPUS_PER_RANK", raising=False)
    assert _placement() == (1.0, "STRICT_PACK")
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_STRATEGY", "SPREAD")
    monkeypatch.setenv("PAGEDLLM_RAY_CPUS_PER_RANK", "2")
    assert _placement() == (2.0, "SPREAD")
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_STRATEGY", "ANYWHERE")
    with pytest.raises(ValueError, match=r"PAGEDLLM_RAY_PLACEMENT_STRATEGY must be one of \['STRICT_PACK', 'PACK', "
                                         r"'SPREAD', 'STRICT_SPREAD'\], got 'ANYWHERE'"):
        _placement()
