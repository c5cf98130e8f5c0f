"""kv_cache_dtype="fp8" / "fp8_e5m2" through the whole engine on a tiny random Llama checkpoint
(transformers' own classes): 4x the float32 blocks, outputs close to float32's (teacher-forced
log-probabilities, greedy tokens), and the checkpoint's k_scale / v_scale: loaded into every
layer (the compressed-tensors and `k_proj.output_scale` names, a scalar and per-head scales),
used by the fp8 cache (its bytes are x / scale), ignored by a float cache, and cut to each
rank's KV heads under tensor parallelism.

Measured on this model (float32 as the reference, 299 teacher-forced positions, 8 greedy prompts
of 32 tokens): |log-probability difference| mean / max 0.0238 / 0.090 (e4m3), 0.0521 / 0.317
(e5m2), against 0.0049 / 0.023 for int8 and 0.0017 / 0.009 for bfloat16; top-1 agreement 0.937
(e4m3), 0.876 (e5m2); greedy first divergence [9, 32, 12, 24, 10, 32, 4, 19] (e4m3).
"""

from __future__ import annotations

import random
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers import kv_cache_dtype as F
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import iter_safetensors_weights
from tests.integration.model_fixtures import TINY_VOCAB, make_hf_model, save_checkpoint, tiny_config

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

N = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
_RNG = random.Random(0)
PROMPTS = [[_RNG.randrange(TINY_VOCAB) for _ in range(n)] for n in (5, 9, 17, 30, 3, 12, 40, 7)]
LONG = [_RNG.randrange(TINY_VOCAB) for _ in range(300)]
# Layer 0: the compressed-tensors names, a per-head k_scale and a scalar v_scale; layer 1: the
# `k_proj.output_scale` form. Sized like calibrated scales (amax / 448 is about 0.01 here).
K_SCALES = [torch.tensor([0.02, 0.03]), torch.tensor([0.025])]
V_SCALES = [torch.tensor(0.015), torch.tensor([0.01, 0.02])]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(plain, with scales): the same tiny Llama, the second with fp8 KV scales added."""
    config = tiny_config("llama")
    plain = save_checkpoint(make_hf_model(config, seed=3), tmp_path_factory.mktemp("tiny-llama"))
    scaled = tmp_path_factory.mktemp("tiny-llama-kv-scales")
    for f in plain.iterdir():
        shutil.copy(f, scaled / f.name)
    from safetensors.torch import save_file

    extra = {
        "model.layers.0.self_attn.k_scale": K_SCALES[0], "model.layers.0.self_attn.v_scale": V_SCALES[0],
        "model.layers.1.self_attn.k_proj.output_scale": K_SCALES[1],
        "model.layers.1.self_attn.v_proj.output_scale": V_SCALES[1],
    }
    save_file(extra, str(scaled / "kv_scales.safetensors"))
    return str(plain), str(scaled), config


def _llm(path, dtype, **kwargs):
    from pagedllm.model_source import default_model_path

    # The model has a 256-token vocabulary of its own; prompts are token ids, the tokenizer only
    # detokenizes.
    return LLM(path, tokenizer=str(default_model_path()), kv_cache_dtype=dtype, kv_cache_space=0.05, block_size=8,
               enable_prefix_caching=False, **kwargs)


@pytest.fixture(scope="module")
def runs(checkpoints):
    """Greedy tokens and teacher-forced log-probabilities of the plain checkpoint per cache type."""
    out = {}
    for dt in ("float32", "fp8", "fp8_e5m2"):
        llm = _llm(checkpoints[0], dt)
        out[dt] = (llm, *_generate(llm))
    return out


def _generate(llm):
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                           use_tqdm=False)]
    scored = llm.generate([{"prompt_token_ids": LONG}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)[0]
    lps = [scored.prompt_logprobs[i][LONG[i]].logprob for i in range(1, len(LONG))]
    top = [next(t for t, lp in scored.prompt_logprobs[i].items() if lp.rank == 1) for i in range(1, len(LONG))]
    return tokens, lps, top


def _first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def test_fp8_cache_holds_four_times_the_blocks(runs):
    blocks = {dt: r[0].llm_engine.num_blocks for dt, r in runs.items()}
    assert blocks["fp8"] == blocks["fp8_e5m2"] == 4 * blocks["float32"]
    assert runs["fp8"][0].llm_engine.model_runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert runs["fp8_e5m2"][0].llm_engine.model_runner.kv_caches[0].dtype == torch.float8_e5m2


@pytest.mark.parametrize("dtype,max_mean,max_diff,min_top1", [("fp8", 0.04, 0.2, 0.9), ("fp8_e5m2", 0.09, 0.5, 0.8)])
def test_teacher_forced_logprobs_close_to_float32(runs, dtype, max_mean, max_diff, min_top1):
    """Bounds about 1.6x the measured figures (module docstring)."""
    _, _, ref_lps, ref_top = runs["float32"]
    _, _, lps, top = runs[dtype]
    diff = [abs(a - b) for a, b in zip(lps, ref_lps)]
    agree = statistics.fmean(a == b for a, b in zip(top, ref_top))
    assert 0 < statistics.fmean(diff) < max_mean and max(diff) < max_diff and agree > min_top1, \
        (statistics.fmean(diff), max(diff), agree)


def test_e5m2_is_coarser_than_e4m3(runs):
    """One mantissa bit fewer: about twice e4m3's distance from float32 (measured 2.2x)."""
    ref = runs["float32"][2]
    mean = {dt: statistics.fmean(abs(a - b) for a, b in zip(runs[dt][2], ref)) for dt in ("fp8", "fp8_e5m2")}
    assert 1.3 < mean["fp8_e5m2"] / mean["fp8"] < 4, mean


def test_greedy_tokens_follow_float32(runs):
    """e4m3: every prompt's first tokens equal float32's (measured first divergences 4..32,
    median 15.5)."""
    div = [_first_divergence(a, b) for a, b in zip(runs["fp8"][1], runs["float32"][1])]
    assert min(div) >= 3 and statistics.median(div) >= 8, div


# ---- checkpoint scales --------------------------------------------------------------------

def _attn(llm, layer):
    return llm.llm_engine.model_runner.model.model.layers[layer].self_attn.attn


def test_checkpoint_scales_load_and_the_fp8_cache_uses_them(checkpoints, runs):
    """Every layer's buffers hold the checkpoint's scales (a scalar expanded to both KV heads).
    After one prompt on two fresh engines (the same blocks), layer 0's fp8 cache (its K/V do not
    depend on any attention yet) stores K / k_scale and V / v_scale per head, to within e4m3's
    rounding of float32's cache; layer 1's stored magnitudes are 1 / scale times float32's. The
    outputs stay close to float32's."""
    llm = _llm(checkpoints[1], "fp8", num_kv_blocks=64)
    for layer in range(2):
        attn = _attn(llm, layer)
        assert torch.equal(attn.k_scale, K_SCALES[layer].expand(2)), attn.k_scale
        assert torch.equal(attn.v_scale, V_SCALES[layer].reshape(-1).expand(2)), attn.v_scale
    ref_llm = _llm(checkpoints[0], "float32", num_kv_blocks=64)
    for engine in (llm, ref_llm):  # prefill only
        engine.generate([{"prompt_token_ids": LONG[:61]}], SamplingParams(max_tokens=1), use_tqdm=False)
    for layer in range(2):
        attn = _attn(llm, layer)
        fp8, ref = llm.llm_engine.model_runner.kv_caches[layer], ref_llm.llm_engine.model_runner.kv_caches[layer]
        assert ref.abs().amax() > 1.0
        for half, scale in ((0, attn.k_scale), (1, attn.v_scale)):
            stored, want = fp8[half].float(), ref[half] / scale[:, None]
            if layer == 0:
                torch.testing.assert_close(stored, want, rtol=2.0**-4, atol=2.0**-10)  # half an ulp of e4m3
                deq = F.dequantize(F.split_kv_cache(fp8, 2, 16, attn.k_scale, attn.v_scale)[half])
                torch.testing.assert_close(deq, ref[half], rtol=2.0**-4, atol=scale.max().item() * 2.0**-10)
            else:
                for h in range(2):
                    ratio = stored[:, :, h].abs().amax() / want[:, :, h].abs().amax()
                    assert 0.9 < ratio < 1.1, (layer, half, h, ratio)
    _, lps, _ = _generate(llm)
    diff = statistics.fmean(abs(a - b) for a, b in zip(lps, runs["float32"][2]))
    assert diff < 0.04, diff


def test_checkpoint_scales_are_ignored_by_a_float_cache(checkpoints, runs):
    """As vLLM: a checkpoint with KV scales on a float32 cache loads without error and gives
    exactly the plain checkpoint's outputs."""
    llm = _llm(checkpoints[1], "float32")
    assert torch.equal(_attn(llm, 1).k_scale, K_SCALES[1].expand(2))  # loaded, not used
    tokens, lps, _ = _generate(llm)
    assert tokens == runs["float32"][1] and lps == runs["float32"][2]


@pytest.mark.parametrize("world", [2, 4])
def test_per_head_scales_are_cut_to_each_ranks_kv_heads(checkpoints, world):
    """Tensor parallelism: each rank reads only its KV heads' scales (2 ranks: one head each;
    4 ranks: the 2 heads replicated, ranks 0-1 head 0, ranks 2-3 head 1); a scalar is whole."""
    _, scaled, config = checkpoints
    for rank in range(world):
        model = LlamaForCausalLM(config, tp=TensorParallelGroup(rank, world, "gloo"))
        model.load_weights(iter_safetensors_weights(scaled, model.checkpoint_slices))
        head = rank * 2 // world
        for layer in range(2):
            attn = model.model.layers[layer].self_attn.attn
            assert attn.k_scale.shape == (1,)
            assert attn.k_scale.item() == K_SCALES[layer].expand(2)[head].item()
            assert attn.v_scale.item() == V_SCALES[layer].reshape(-1).expand(2)[head].item()


def test_bad_checkpoint_scale_is_a_value_error(checkpoints, tmp_path):
    plain, _, config = checkpoints
    folder = Path(tmp_path)
    for f in Path(plain).iterdir():
        shutil.copy(f, folder / f.name)
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.k_scale": torch.ones(3)}, str(folder / "bad.safetensors"))
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"Loading model.layers.0.self_attn.k_scale: .*one per KV head \(2\)"):
        model.load_weights(iter_safetensors_weights(str(folder)))


def test_compiled_decode_graphs_on_an_fp8_cache(checkpoints):
    """compile_batch_sizes with fp8: the registered decode op takes the layers' scales as
    optional tensor inputs, so the compiled steps run (on the checkpoint's scales) and give the
    eager engine's greedy tokens (about 10 s of compiling)."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    compiled = _llm(checkpoints[1], "fp8", max_num_seqs=1, enforce_eager=False, compile_batch_sizes=[1])
    runner = compiled.llm_engine.model_runner
    assert runner.wait_for_compilation(timeout=900), runner.decode_graphs._failed
    before = runner.decode_graphs.steps_run
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert runner.decode_graphs.steps_run - before >= 30
    eager = _llm(checkpoints[1], "fp8", max_num_seqs=1, enforce_eager=True)
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


def test_other_scale_names_vllm_maps(checkpoints):
    """The deprecated single `kv_scale` sets both scales; ModelOpt's `k_proj.k_scale` /
    `v_proj.v_scale` and our own `attn.k_scale` set theirs; the fp8-attention `q_scale` /
    `prob_scale` are accepted and unused."""
    import itertools

    plain, _, config = checkpoints
    extra = [("model.layers.0.self_attn.kv_scale", torch.tensor(0.5)),
             ("model.layers.1.self_attn.k_proj.k_scale", torch.tensor([0.25, 0.75])),
             ("model.layers.1.self_attn.v_proj.v_scale", torch.tensor([2.0])),
             ("model.layers.1.self_attn.attn.k_scale", torch.tensor([0.125, 0.75])),  # later names win
             ("model.layers.0.self_attn.q_scale", torch.tensor(3.0)),
             ("model.layers.0.self_attn.prob_scale", torch.tensor(1.0))]
    model = LlamaForCausalLM(config)
    model.load_weights(itertools.chain(iter_safetensors_weights(plain), extra))
    layers = [layer.self_attn.attn for layer in model.model.layers]
    assert layers[0].k_scale.tolist() == layers[0].v_scale.tolist() == [0.5, 0.5]
    assert layers[1].k_scale.tolist() == [0.125, 0.75] and layers[1].v_scale.tolist() == [2.0, 2.0]
