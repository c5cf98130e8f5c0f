"""Speculative decoding of constrained samples (issue 26) on SmolLM2: n-gram proposals are
checked against the grammar (a draft the grammar refuses ends the proposal), each verified
position is masked by the grammar state after the drafts before it, and the output equals
the plain engine's token for token; allowed_token_ids and bad_words likewise."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams
from tests.integration.test_spec_decode import SPEC, _tokens, run_checked

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

pytest.importorskip("xgrammar")

ITEMS = ["apple", "banana", "cherry", "apple", "banana", "cherry", "apple", "banana"]
JSON_PROMPT = ("Copy this JSON exactly: " + json.dumps({"items": ITEMS, "count": 8})
               + "\nCopy: ")
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                                            "count": {"type": "integer"}},
          "required": ["items", "count"]}


@pytest.fixture(scope="module")
def engines():
    kw = dict(max_model_len=1024, num_kv_blocks=256)
    return LLM(**kw), LLM(**kw, speculative_config=SPEC)


def _both(engines, prompts, params):
    plain, spec = engines
    before = spec.llm_engine.core.speculation.stats.num_accepted_tokens
    got = _tokens(run_checked(spec, prompts, params))
    assert got == _tokens(plain.generate(prompts, params, use_tqdm=False))
    return spec.llm_engine.core.speculation.stats.num_accepted_tokens - before, got


def test_a_json_schema_with_copied_drafts_equals_plain(engines):
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    accepted, got = _both(engines, [JSON_PROMPT, JSON_PROMPT.replace("apple", "plum")], params)
    assert accepted > 0  # the constrained samples speculated
    text = engines[1].get_tokenizer().decode(got[0][0], skip_special_tokens=True)
    assert set(json.loads(text)) == {"items", "count"}  # valid under the schema


def test_drafts_the_grammar_refuses_are_cut(engines):
    """The prompt repeats words the n-gram proposer copies; the regex allows digits only, so
    every proposal is cut to its grammar-valid prefix (often nothing)."""
    prompt = "one two three one two three one two three one two"
    params = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9 ]{1,30}"))
    _, got = _both(engines, [prompt], params)
    text = engines[1].get_tokenizer().decode(got[0][0])
    assert all(c in "0123456789 " for c in text), text


def test_allowed_token_ids_and_bad_words_with_drafts_equal_plain(engines):
    tok = engines[1].get_tokenizer()
    prompt = "red green blue red green blue red green blue red green"
    words = tok(" red green blue", add_special_tokens=False).input_ids
    allowed = sorted(set(words) | {tok.eos_token_id})
    params = [SamplingParams(temperature=0.0, max_tokens=16, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, max_tokens=16, bad_words=[" blue"])]
    accepted, got = _both(engines, [prompt, prompt], params)
    assert accepted > 0
    assert set(got[0][0]) <= set(allowed)
    assert "blue" not in tok.decode(got[1][0])
