"""The one validation (InputProcessor.validate), after the defaults are filled: what passes it
always decodes and is accepted in the core, offline and in the server alike (issue 23)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.core_messages import EngineCoreRequest, decode_request, encode
from pagedllm.engine.input_processing import InputProcessor
from pagedllm.sampling_params import SamplingParams

VOCAB, MAX_LEN = 1000, 512


def processor(max_num_seqs: int = 8, max_logprobs: int = 20) -> InputProcessor:
    return InputProcessor(None, VOCAB, MAX_LEN, lambda n, k: None, max_logprobs=max_logprobs,
                          max_num_seqs=max_num_seqs)


def test_min_tokens_past_the_filled_max_tokens_is_refused_before_the_core():
    """The reproduction: min_tokens=5000 with no max_tokens passed the front end, and the core's
    input thread died decoding it (msgspec re-runs SamplingParams' checks)."""
    params = SamplingParams(min_tokens=5000, max_tokens=None)
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens=508"):
        processor().validate([1, 2, 3, 4], params)


@pytest.mark.parametrize("kwargs", [
    dict(min_tokens=100, max_tokens=None), dict(n=8), dict(best_of=8, n=2), dict(seed=2**63 - 1),
    dict(seed=-(2**63)), dict(logprobs=-1), dict(logit_bias={5: 1e30, 6: -1e30}),
])
def test_what_passes_validation_decodes_in_the_core(kwargs):
    params = SamplingParams(**kwargs)
    processor(max_logprobs=-1).validate([1, 2, 3], params)
    request = EngineCoreRequest("r", [1, 2, 3], params, 0.0)
    decoded = decode_request(encode(request))  # the core's decode re-runs every check
    processor(max_logprobs=-1).validate(decoded.prompt_token_ids, decoded.sampling_params)
    assert decoded.sampling_params.max_tokens == params.max_tokens


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=9), "n=9"), (dict(best_of=1_000_000), "best_of=1000000"), (dict(n=1000), "n=1000"),
    (dict(n=9, use_beam_search=True, temperature=0.0, max_tokens=4), "n=9"),
])
def test_n_and_best_of_are_bounded_by_max_num_seqs(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: must be less than or equal to 8"):
        processor(max_num_seqs=8).validate([1, 2], SamplingParams(**kwargs))


@pytest.mark.parametrize("seed", [2**63, 2**64, -(2**63) - 1])
def test_a_seed_outside_64_bits_is_refused_at_construction(seed):
    """It used to pass validation and fail inside the step (manual_seed overflow), taking the
    batch with it."""
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=seed)


def test_logit_bias_is_clamped_so_the_row_stays_finite():
    params = SamplingParams(logit_bias={1: 1e30, 2: -1e30, 3: 7.5})
    assert params.logit_bias == {1: 100.0, 2: -100.0, 3: 7.5}
    row = torch.zeros(4)
    for t, b in params.logit_bias.items():
        row[t] += b
    assert torch.isfinite(torch.softmax(row, -1)).all()


@pytest.mark.slow  # builds the server's app: 3 s
def test_logprobs_minus_one_means_the_vocabulary_offline_and_in_the_server():
    params = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    processor(max_logprobs=-1).validate([1], params)
    assert params.logprobs == VOCAB and params.prompt_logprobs == VOCAB
    with pytest.raises(ValueError, match=f"logprobs={VOCAB}: must be less than or equal to 20"):
        processor(max_logprobs=20).validate([1], SamplingParams(logprobs=-1))
    with pytest.raises(ValueError, match="non-negative or -1"):
        SamplingParams(logprobs=-2)
