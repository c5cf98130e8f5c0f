"""Sampler: greedy/top-k/top-p/min-p, penalties, logit bias, min_tokens, seeds, logprobs."""

import math

import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from pagedllm.layers.sampling_draw import apply_min_p, apply_top_k_top_p, make_generator
from pagedllm.layers.sampling_logprobs import compute_prompt_logprobs
from pagedllm.layers.sampling_penalties import apply_penalties
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
V = 500


def rows_for(params_list, prompts=None, outputs=None, generators=None):
    n = len(params_list)
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    generators = generators or [None] * n
    return [
        SamplingRow(p, pr, o, g) for p, pr, o, g in zip(params_list, prompts, outputs, generators)
    ]


def sample(logits, params_list, eos_token_id=None, **kw):
    md = SamplingMetadata.build(
        rows_for(params_list, **kw), eos_token_id=eos_token_id, device=logits.device
    )
    return Sampler()(logits, md)


def rand_logits(rows, vocab=V, seed=0, device="cpu", scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_argmax_and_input_untouched(device):
    logits = rand_logits(8, device=device)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)
    assert out.sampled_logprobs == [None] * 8
    assert out.top_logprobs == [None] * 8


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_and_tiny_top_p_equal_argmax(device):
    logits = rand_logits(8, seed=1, device=device)
    argmax = logits.argmax(-1).tolist()
    for _ in range(5):
        assert sample(logits, [SamplingParams(top_k=1)] * 8).sampled_token_ids == argmax
        assert sample(logits, [SamplingParams(top_p=1e-6)] * 8).sampled_token_ids == argmax
        assert sample(logits, [SamplingParams(min_p=1.0)] * 8).sampled_token_ids == argmax


def test_mixed_greedy_and_random_batch():
    logits = rand_logits(6, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 3
    out = sample(logits, params)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_masks():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    k_only = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None)
    assert torch.isinf(k_only).tolist() == [[True, False, True, False]]
    # Nucleus: keep the smallest set whose mass reaches p (vLLM: drop tokens whose ascending
    # cumulative mass is <= 1 - p).
    p75 = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.75]))
    assert torch.isinf(p75).tolist() == [[True, False, True, False]]
    p85 = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.85]))
    assert torch.isinf(p85).tolist() == [[True, False, False, False]]
    both = apply_top_k_top_p(logits.clone(), torch.tensor([1]), torch.tensor([0.85]))
    assert torch.isinf(both).tolist() == [[True, False, True, True]]
    # Off values leave the row bit-for-bit unchanged; kept values are unchanged.
    off = apply_top_k_top_p(logits.clone(), torch.tensor([0]), torch.tensor([1.0]))
    assert torch.equal(off, logits)
    assert torch.equal(p85[0, 1:], logits[0, 1:])


def test_top_k_keeps_ties_and_handles_k_above_vocab():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, 3.0, 0.0, 2.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([1, 10]), None)
    assert torch.isinf(out).tolist() == [[True, False, False, True], [False] * 4]


def test_min_p_mask():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    out = apply_min_p(probs.log(), torch.tensor([0.45]))  # keep p >= 0.18
    assert torch.isinf(out).tolist() == [[False, False, False, True]]


def test_sampling_support_respects_filters():
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    logits = probs.log().expand(4000, -1).contiguous()
    cases = {
        "top_k": (SamplingParams(top_k=3), {0, 1, 2}),
        "top_p": (SamplingParams(top_p=0.55), {0, 1}),
        "min_p": (SamplingParams(min_p=0.5), {0, 1, 2}),  # p >= 0.175
    }
    for name, (params, allowed) in cases.items():
        got = set(sample(logits, [params] * logits.shape[0]).sampled_token_ids)
        assert got == allowed, name


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    n = 40000
    out = sample(logits.expand(n, -1).contiguous(), [SamplingParams(temperature=temperature)] * n)
    freq = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=5).float() / n
    expected = torch.softmax(logits / temperature, -1)
    assert (freq - expected).abs().max() < 0.015, (freq, expected)


def test_seeded_sampling_matches_softmax():
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.3]])
    params = SamplingParams(temperature=1.0, seed=7)
    g = make_generator(7)
    n = 3000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample(logits, [params], generators=[g]).sampled_token_ids[0]] += 1
    expected = torch.softmax(logits[0], -1)
    assert (counts / n - expected).abs().max() < 0.04


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.5, 0.0]])
    prompt = [0, 3, 3]
    output = [2, 2, 1, 4, 2]
    rep, freq, pres = 1.3, 0.4, 0.25
    params = SamplingParams(
        temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
    )
    md = SamplingMetadata.build([SamplingRow(params, prompt, output)])
    processed = logits.clone()
    apply_penalties(processed, md)
    expected = []
    for tok, x in enumerate(logits[0].tolist()):
        if tok in prompt or tok in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(tok)
        x -= freq * count
        x -= pres * (count > 0)
        expected.append(x)
    assert torch.allclose(processed[0], torch.tensor(expected), atol=1e-6)
    # Token 0 (2.0 in the prompt) -> 2/1.3 = 1.538; token 4 (1.5, output once) ->
    # 1.5/1.3 - 0.4 - 0.25 = 0.504: greedy picks token 0.
    assert sample(logits, [params], prompts=[prompt], outputs=[output]).sampled_token_ids == [0]


def test_frequency_presence_only_count_output_tokens():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
    # Token 0 appears only in the prompt: no frequency/presence penalty.
    assert sample(logits, [params], prompts=[[0, 0, 0]], outputs=[[]]).sampled_token_ids == [0]
    assert sample(logits, [params], prompts=[[]], outputs=[[0]]).sampled_token_ids == [1]


def test_penalty_rows_do_not_touch_neutral_rows():
    logits = rand_logits(3, seed=4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
    ]
    top = logits.argmax(-1).tolist()
    seen = [top[:1], top[1:2], top[2:]]
    out = sample(logits, params, prompts=seen, outputs=seen)
    assert out.sampled_token_ids[0] == top[0] and out.sampled_token_ids[2] == top[2]
    assert out.sampled_token_ids[1] != top[1]


def test_logit_bias():
    logits = torch.tensor([[1.0, 0.5, 0.2, 0.9]])
    assert sample(logits, [SamplingParams(temperature=0.0)]).sampled_token_ids == [0]
    assert sample(
        logits, [SamplingParams(temperature=0.0, logit_bias={2: 0.81})]
    ).sampled_token_ids == [2]
    assert sample(
        logits, [SamplingParams(temperature=0.0, logit_bias={2: 0.79})]
    ).sampled_token_ids == [0]
    # A -100 bias bans a token even under sampling.
    many = logits.expand(2000, -1).contiguous()
    out = sample(many, [SamplingParams(logit_bias={0: -100.0, 3: -100.0})] * 2000)
    assert set(out.sampled_token_ids) == {1, 2}
    with pytest.raises(ValueError, match="out-of-vocab"):
        sample(logits, [SamplingParams(logit_bias={4: 1.0})])


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])  # EOS = 1, stop id = 2
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])
    for n_out, expected in [(0, 3), (2, 3), (3, 1), (10, 1)]:
        out = sample(logits, [params], eos_token_id=1, outputs=[[4] * n_out])
        assert out.sampled_token_ids == [expected], n_out
    # EOS ids added through update_from_generation_config are blocked too.
    p2 = SamplingParams(temperature=0.0, min_tokens=1)
    p2.update_from_generation_config({}, model_eos_token_id=1)
    assert sample(logits, [p2], outputs=[[]]).sampled_token_ids == [2]
    md = SamplingMetadata.build(
        rows_for([params, SamplingParams()], outputs=[[], []]), eos_token_id=1
    )
    assert md.min_tokens_mask == [{1, 2}, None]


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    logits = rand_logits(4, seed=5, device=device)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, logprobs=0, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(temperature=2.0, logprobs=7, presence_penalty=1.0),
    ]
    out = sample(logits, params, outputs=[[1, 2], [3], [], [4, 4]])
    ref = torch.log_softmax(logits.float(), -1).cpu()
    for i, k in enumerate([3, 0, None, 7]):
        tok = out.sampled_token_ids[i]
        if k is None:
            assert out.sampled_logprobs[i] is None and out.top_logprobs[i] is None
            assert out.logprobs_dict(i) is None
            continue
        assert math.isclose(out.sampled_logprobs[i], ref[i, tok].item(), abs_tol=1e-5)
        assert out.sampled_ranks[i] == int((ref[i] >= ref[i, tok]).sum())
        top = out.top_logprobs[i]
        assert len(top) == k
        vals, ids = ref[i].topk(k) if k else (torch.tensor([]), torch.tensor([]))
        assert [t for t, _ in top] == ids.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in top]), vals, atol=1e-5)
        d = out.logprobs_dict(i, decode=lambda t: f"<{t}>")
        assert next(iter(d)) == tok  # sampled token first
        assert d[tok].decoded_token == f"<{tok}>"
        assert len(d) == k + (tok not in ids.tolist())
        for rank, t in enumerate(ids.tolist(), 1):
            if t != tok:
                assert d[t].rank == rank
    assert out.sampled_ranks[0] == 1  # greedy picks the top token


def test_compute_prompt_logprobs():
    logits = rand_logits(5, vocab=50, seed=6)
    nxt = [3, 7, 7, 0, 49]
    res = compute_prompt_logprobs(logits, nxt, num_logprobs=2)
    ref = torch.log_softmax(logits, -1)
    assert len(res) == 5
    for j, d in enumerate(res):
        t = nxt[j]
        assert isinstance(d[t], Logprob)
        assert math.isclose(d[t].logprob, ref[j, t].item(), abs_tol=1e-5)
        assert d[t].rank == int((ref[j] >= ref[j, t]).sum())
        top_ids = ref[j].topk(2).indices.tolist()
        assert set(d) == {t, *top_ids}
    assert all(len(d) == 1 for d in compute_prompt_logprobs(logits, nxt, 0))
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, nxt[:3], 1)


def _other_rows(step, k):
    """A varied batch companion: greedy, unseeded, other seeds, filters, penalties, bias."""
    kinds = [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=1.3, top_p=0.5), None),
        (SamplingParams(temperature=0.9, seed=1234, min_p=0.1), "gen"),
        (SamplingParams(top_k=3, repetition_penalty=1.7, logit_bias={5: 3.0}), None),
        (SamplingParams(temperature=0.5, frequency_penalty=1.0, logprobs=2), None),
        (SamplingParams(temperature=0.0, min_tokens=5), None),
        (SamplingParams(top_k=40, top_p=0.8, seed=99), "gen"),
    ]
    return kinds[(step + k) % len(kinds)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=42),
        SamplingParams(temperature=1.1, top_k=20, top_p=0.9, min_p=0.02, seed=7),
        SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.5,
                       frequency_penalty=0.3, logit_bias={3: 2.0}, seed=2024, logprobs=2),
    ],
)
def test_seeded_row_independent_of_batch(device, params):
    steps = 40
    step_logits = [rand_logits(1, seed=100 + s, device=device, scale=2.0) for s in range(steps)]
    prompt = list(range(0, 60, 3))

    def run_alone():
        g = make_generator(params.seed, device)
        outs = []
        for s in range(steps):
            out = sample(step_logits[s], [params], prompts=[prompt], outputs=[list(outs)],
                         generators=[g])
            outs.append(out.sampled_token_ids[0])
        return outs

    def run_in_batch(position):
        g = make_generator(params.seed, device)
        others = [None] * 8
        outs = []
        other_outs = [[] for _ in range(8)]
        torch.manual_seed(position)
        for s in range(steps):
            plist, gens, outputs, prompts = [], [], [], []
            noise = rand_logits(8, seed=10_000 + s * 8 + position, device=device)
            logits = noise.clone()
            for k in range(8):
                if k == position:
                    plist.append(params)
                    gens.append(g)
                    outputs.append(list(outs))
                    prompts.append(prompt)
                    logits[k] = step_logits[s][0]
                else:
                    p, kind = _other_rows(s, k)
                    if others[k] is None or kind is None:
                        others[k] = make_generator(p.seed or 0, device) if kind else None
                    plist.append(p)
                    gens.append(others[k])
                    outputs.append(other_outs[k][-10:])
                    prompts.append([k, k + 1])
            out = sample(logits, plist, eos_token_id=0, prompts=prompts, outputs=outputs,
                         generators=gens)
            outs.append(out.sampled_token_ids[position])
            for k in range(8):
                other_outs[k].append(out.sampled_token_ids[k])
        return outs

    alone = run_alone()
    assert alone == run_alone()  # reproducible
    assert len(set(alone)) > 3  # it really samples
    for position in (0, 3, 7):
        assert run_in_batch(position) == alone, position
    # A different seed gives a different stream.
    other = params.clone()
    other.seed = params.seed + 1
    g = make_generator(other.seed, device)
    diff = [
        sample(step_logits[s], [other], generators=[g], prompts=[prompt], outputs=[[]])
        .sampled_token_ids[0]
        for s in range(steps)
    ]
    assert diff != alone


def test_two_rows_same_seed_same_tokens():
    logits = rand_logits(1, seed=9).expand(2, -1).contiguous()
    p = SamplingParams(temperature=1.0, seed=5)
    g1, g2 = make_generator(5), make_generator(5)
    for _ in range(20):
        a, b = sample(logits, [p, p], generators=[g1, g2]).sampled_token_ids
        assert a == b


def test_metadata_flags():
    md = SamplingMetadata.build(rows_for([SamplingParams(temperature=0.0)] * 2))
    assert md.all_greedy and not md.all_random and md.no_penalties and md.no_top_k_top_p_min_p
    assert md.max_num_logprobs is None
    md = SamplingMetadata.build(
        rows_for([SamplingParams(top_k=5, logprobs=2), SamplingParams(frequency_penalty=0.1)])
    )
    assert md.all_random and not md.all_greedy and not md.no_penalties
    assert not md.no_top_k and md.no_top_p and md.no_min_p
    assert md.max_num_logprobs == 2
    assert md.top_ks.tolist() == [5, 0]
    assert md.temperatures.dtype == torch.float32


def test_bf16_logits_accepted():
    logits = rand_logits(3, seed=11).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=1)] * 3)
    assert out.sampled_token_ids == logits.float().argmax(-1).tolist()


@pytest.mark.gpu
def test_cpu_generator_with_cuda_logits_matches_cpu():
    params = SamplingParams(temperature=0.9, top_k=50, seed=3)
    logits = [rand_logits(1, seed=200 + s) for s in range(20)]
    g_cpu, g_mixed = make_generator(3), make_generator(3)
    on_cpu = [sample(x, [params], generators=[g_cpu]).sampled_token_ids[0] for x in logits]
    on_gpu = [
        sample(x.cuda(), [params], generators=[g_mixed]).sampled_token_ids[0] for x in logits
    ]
    assert on_gpu == on_cpu


def test_exponential_race_uses_the_row_generator():
    # token = argmax(probs / q) with q drawn from the row's generator: recomputed by hand.
    logits = rand_logits(1, vocab=50, seed=12)
    params = SamplingParams(temperature=0.6, seed=11)
    out = sample(logits, [params], generators=[make_generator(11)]).sampled_token_ids[0]
    q = torch.empty(50).exponential_(generator=make_generator(11))
    assert out == int((torch.softmax(logits[0] / 0.6, -1) / q).argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_rows_is_argmax_ties_infinities_and_nan_included(dtype):
    from pagedllm.layers.sampling_draw import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3000, generator=g).to(dtype)
    x[1, [5, 700, 2999]] = 50.0  # ties: the first wins
    x[2] = float("-inf")
    x[3, 17] = float("nan")  # NaN counts as the largest, as argmax has it
    x[4, [0, 10]] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[1].item() == 5


def test_min_p_comes_before_top_p_as_in_vllm():
    """p = (0.4, 0.3, 40 tokens of 0.0075). vLLM's order: min-p 0.1 drops the small ones, the
    rest renormalised is (0.57, 0.43), top-p 0.5 keeps token 0 alone. The other order (top-p
    first) would keep tokens 0 and 1."""
    from pagedllm.layers.sampling_draw import random_sample

    probs = torch.tensor([0.4, 0.3] + [0.3 / 40] * 40)
    logits = probs.log().repeat(200, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    ones = torch.ones(200)
    sampled = random_sample(logits.clone(), ones, torch.zeros(200, dtype=torch.long),
                            ones * 0.5, ones * 0.1, gens)
    assert set(sampled.tolist()) == {0}
    # each alone: min-p keeps 0 and 1, top-p keeps 0 and 1 as well
    for top_p, min_p in ((1.0, 0.1), (0.5, 0.0)):
        sampled = random_sample(logits.clone(), ones, torch.zeros(200, dtype=torch.long),
                                ones * top_p, ones * min_p, gens)
        assert set(sampled.tolist()) == {0, 1}


def test_kept_penalty_counts_equal_counts_rebuilt_every_step():
    """A sequence's PenaltyCounts, updated with each step's new tokens, give the same logits
    as counting its whole lists again, step after step (ids outside the vocabulary ignored,
    a shorter output list, as after a reset, starts the counts over)."""
    from pagedllm.layers.sampling_penalties import PenaltyCounts

    rng = torch.Generator().manual_seed(3)
    V = 50
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2)
    prompt = [1, 2, 2, 49, 60, -1]
    outputs: list[int] = []
    kept = PenaltyCounts()
    for step in range(40):
        outputs.extend(torch.randint(0, V + 5, (step % 3,), generator=rng).tolist())
        if step == 25:
            outputs = outputs[:3]
        logits = torch.randn(1, V, generator=rng)
        with_kept = SamplingMetadata.build([SamplingRow(params, prompt, list(outputs),
                                                        penalty_counts=kept)])
        rebuilt = SamplingMetadata.build([SamplingRow(params, prompt, list(outputs))])
        a, b = logits.clone(), logits.clone()
        apply_penalties(a, with_kept)
        apply_penalties(b, rebuilt)
        assert torch.equal(a, b), step
    assert kept.counted == len(outputs)
