"""SamplingParams: defaults, normalisation and every validation message (vLLM's wording)."""

import re

import pytest

from pagedllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.best_of is None
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.logprobs is None
    assert p.prompt_logprobs is None
    assert p.detokenize is True
    assert p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.logit_bias is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.output_text_buffer_length == 0
    assert p.sampling_type is SamplingType.RANDOM
    assert not p.is_greedy


def test_max_tokens_none_allowed():
    p = SamplingParams(max_tokens=None, min_tokens=1000)
    assert p.max_tokens is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be at least 1, got 0."),
        (
            dict(n=2, best_of=1),
            "best_of must be greater than or equal to n, got n=2 and best_of=1.",
        ),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
        (dict(presence_penalty=-2.01), "presence_penalty must be in [-2, 2], got -2.01."),
        (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3.0."),
        (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
        (dict(repetition_penalty=-1), "repetition_penalty must be greater than zero, got -1.0."),
        (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
        (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
        (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1."),
        (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
        (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
        (
            dict(max_tokens=5, min_tokens=6),
            "min_tokens must be less than or equal to max_tokens=5, got 6.",
        ),
        (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2."),
        (dict(prompt_logprobs=-2), "prompt_logprobs must be non-negative or -1, got -2."),
        (dict(seed=2**63), f"seed must be in [{-2**63}, {2**63 - 1}] (a 64-bit integer), got {2**63}."),
        (dict(seed=-2**63 - 1), f"seed must be in [{-2**63}, {2**63 - 1}] (a 64-bit integer), got {-2**63 - 1}."),
        (dict(stop=["ok", ""]), "stop cannot contain an empty string."),
        (dict(stop=""), "stop cannot contain an empty string."),
        (dict(stop=[1, 2]), "stop must be a string or a list of strings, got [1, 2]."),
        (dict(stop=5), "stop must be a string or a list of strings, got 5."),
        (
            dict(stop_token_ids=[1, "2"]),
            "stop_token_ids must contain only integers, got [1, '2'].",
        ),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative token ids, got [-1]."),
        (dict(stop_token_ids=7), "stop_token_ids must be a list of integers, got 7."),
        (
            dict(stop="x", detokenize=False),
            "stop strings are only supported when detokenize is True. Set detokenize=True to "
            "use stop.",
        ),
        # types
        (dict(temperature="0.5"), "temperature must be a float, got str: '0.5'."),
        (dict(temperature=None), "temperature must be a float, got NoneType: None."),
        (dict(temperature=True), "temperature must be a float, got bool: True."),
        (dict(temperature=float("nan")), "temperature must be a finite number, got nan."),
        (dict(top_p=float("inf")), "top_p must be a finite number, got inf."),
        (dict(n=1.0), "n must be an int, got float: 1.0."),
        (dict(n="2"), "n must be an int, got str: '2'."),
        (dict(top_k=2.5), "top_k must be an int, got float: 2.5."),
        (dict(max_tokens=16.0), "max_tokens must be an int, got float: 16.0."),
        (dict(max_tokens=True), "max_tokens must be an int, got bool: True."),
        (dict(min_tokens=None), "min_tokens must be an int, got NoneType: None."),
        (dict(seed="abc"), "seed must be an int, got str: 'abc'."),
        (dict(logprobs=1.5), "logprobs must be an int, got float: 1.5."),
        (dict(ignore_eos="yes"), "ignore_eos must be a bool, got str: 'yes'."),
        (dict(skip_special_tokens=1), "skip_special_tokens must be a bool, got int: 1."),
        (dict(output_kind="delta"), "output_kind must be a RequestOutputKind, got 'delta'."),
        (dict(logit_bias=[1, 2]), "logit_bias must be a dict of token id to bias, got list."),
        (dict(logit_bias={"abc": 1.0}), "logit_bias keys must be token ids (int), got 'abc'."),
        (dict(logit_bias={-3: 1.0}), "logit_bias keys must be non-negative token ids, got -3."),
        (dict(logit_bias={3: "x"}), "logit_bias[3] must be a float, got str: 'x'."),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**kwargs)


def test_boundary_values_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=5.0)
    SamplingParams(top_p=1e-9, top_k=1, min_p=1.0, logprobs=0, prompt_logprobs=0)
    SamplingParams(max_tokens=1, min_tokens=1)
    SamplingParams(temperature=0.0, n=1)
    SamplingParams(n=4, temperature=0.7, best_of=4)


def test_int_floats_are_converted():
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float)


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    lst = ["x"]
    p = SamplingParams(stop=lst)
    assert p.stop == ["x"] and p.stop is not lst
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(stop_token_ids=[7]).all_stop_token_ids == {7}


def test_output_text_buffer_length():
    assert SamplingParams(stop=["a", "abcd"]).output_text_buffer_length == 3
    p = SamplingParams(stop=["abcd"], include_stop_str_in_output=True)
    assert p.output_text_buffer_length == 0


def test_top_k_minus_one_normalised_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_seed_minus_one_means_none_and_logprobs_true_means_one():
    p = SamplingParams(seed=-1, logprobs=True, prompt_logprobs=True)
    assert p.seed is None
    assert p.logprobs == 1 and p.prompt_logprobs == 1


def test_greedy_detection_and_reset():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.3)
    assert p.sampling_type is SamplingType.GREEDY
    assert p.is_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=9e-6).is_greedy
    # Below 1e-2 (but not greedy) the temperature is raised to 1e-2, as vLLM.
    p = SamplingParams(temperature=1e-3, top_k=3)
    assert p.temperature == 1e-2 and not p.is_greedy and p.top_k == 3
    assert SamplingParams(temperature=0.5, seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY


def test_logit_bias_string_keys_converted():
    p = SamplingParams(logit_bias={"12": 5, 7: -1.5})
    assert p.logit_bias == {12: 5.0, 7: -1.5}
    assert all(isinstance(k, int) for k in p.logit_bias)


def test_verify_token_ids():
    p = SamplingParams(logit_bias={5: 1.0, 100: 2.0, 200: 1.0})
    p.verify_token_ids(201)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "token_id(s) [100, 200] in logit_bias contain out-of-vocab token ids. "
            "Vocabulary size: 100"
        ),
    ):
        p.verify_token_ids(100)


def test_update_from_generation_config():
    p = SamplingParams(stop_token_ids=[9])
    p.update_from_generation_config({"eos_token_id": [2, 5]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 5, 9}
    assert p.stop_token_ids == [9, 5]  # extra EOS ids stop generation too
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 3}, model_eos_token_id=2)
    assert q.all_stop_token_ids == {2, 3}
    assert q.stop_token_ids == []


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], logit_bias={1: 1.0}, seed=5)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("b")
    c.stop_token_ids.append(2)
    c.logit_bias[2] = 3.0
    c.all_stop_token_ids.add(99)
    assert p.stop == ["a"] and p.stop_token_ids == [1] and p.logit_bias == {1: 1.0}
    assert 99 not in p.all_stop_token_ids


def test_repr_names_fields():
    r = repr(SamplingParams(temperature=0.5, stop="x"))
    assert "temperature=0.5" in r and "stop=['x']" in r
    assert "_all_stop_token_ids" not in r


def test_beam_search_params():
    b = BeamSearchParams(beam_width=4, max_tokens=32)
    assert (b.ignore_eos, b.temperature, b.length_penalty, b.include_stop_str_in_output) == (
        False,
        0.0,
        1.0,
        False,
    )
    with pytest.raises(ValueError, match=r"^beam_width must be at least 1, got 0\.$"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match=r"^max_tokens must be at least 1, got 0\.$"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match=r"^temperature must be non-negative, got -1\.0\.$"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=-1)


def test_parallel_greedy_samples_allowed():
    # vLLM v1 allows n > 1 with greedy: the samples are equal (and share every block).
    p = SamplingParams(n=4, temperature=0.0)
    assert p.n == 4 and p.is_greedy


def test_public_import_paths():
    """vLLM's paths stay public after the split into beam_search_params.py and
    structured_outputs_params.py: one class each, whichever path a user imports."""
    import pagedllm
    from pagedllm import sampling_params
    from pagedllm.beam_search_params import BeamSearchParams as Beam
    from pagedllm.structured_outputs_params import StructuredOutputsParams

    assert pagedllm.SamplingParams is SamplingParams is sampling_params.SamplingParams
    assert pagedllm.BeamSearchParams is BeamSearchParams is Beam
    assert sampling_params.StructuredOutputsParams is StructuredOutputsParams
