"""Structured outputs, allowed_token_ids and bad_words on SmolLM2, offline (LLM.generate):
every mode's output is valid, n=3 sampled too; a bad constraint is a ValueError that leaves
the engine serving others; aborts free the matcher."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm import SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as a JSON object with a name, an age and a city: "


def _gen(llm, so, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0.0)
    return llm.generate([prompt], SamplingParams(structured_outputs=so, **kw),
                        use_tqdm=False)[0].outputs


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "n3-sampled"])
def test_json_schema(smollm2_llm, sampled):
    kw = dict(n=3, temperature=0.9, seed=11) if sampled else {}
    outs = _gen(smollm2_llm, StructuredOutputsParams(json=PERSON), **kw)
    assert len(outs) == (3 if sampled else 1)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)


def test_json_schema_as_string_and_no_whitespace(smollm2_llm):
    (o,) = _gen(smollm2_llm, StructuredOutputsParams(json=json.dumps(PERSON),
                                                     disable_any_whitespace=True))
    value = json.loads(o.text)
    jsonschema.validate(value, PERSON)
    assert o.text == json.dumps(value)  # the fixed layout: no free whitespace


def test_json_object(smollm2_llm):
    (o,) = _gen(smollm2_llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                max_tokens=120)
    assert o.finish_reason == "stop"
    assert isinstance(json.loads(o.text), dict)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "n3-sampled"])
def test_regex(smollm2_llm, sampled):
    pattern = r"[A-Z][a-z]{2,8}-\d{3}"
    kw = dict(n=3, temperature=1.0, seed=5) if sampled else {}
    for o in _gen(smollm2_llm, StructuredOutputsParams(regex=pattern), "A product code: ", **kw):
        assert re.fullmatch(pattern, o.text), o.text
        assert o.finish_reason == "stop"


def test_choice(smollm2_llm):
    choices = ["positive", "negative", "neutral"]
    outs = _gen(smollm2_llm, StructuredOutputsParams(choice=choices),
                "Review: 'I loved it!' Sentiment:", n=3, temperature=1.0, seed=2)
    assert all(o.text in choices for o in outs)


def test_ebnf_grammar(smollm2_llm):
    grammar = 'root ::= expr "=" num\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]{0,2}'
    outs = _gen(smollm2_llm, StructuredOutputsParams(grammar=grammar), "An arithmetic fact: ",
                n=3, temperature=0.8, seed=9)
    for o in outs:
        assert re.fullmatch(r"[1-9]\d{0,2}([+*][1-9]\d{0,2})*=[1-9]\d{0,2}", o.text), o.text


def test_structural_tag(smollm2_llm):
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<answer>"},
        {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
        {"type": "const_string", "value": "</answer>"},
    ]}}
    (o,) = _gen(smollm2_llm, StructuredOutputsParams(structural_tag=tag), "Pick a number: ")
    m = re.fullmatch(r"<answer>(.*)</answer>", o.text, re.S)
    assert m, o.text
    assert isinstance(json.loads(m.group(1))["n"], int)


def test_mixed_batch_leaves_free_rows_alone(smollm2_llm):
    """A constrained request batched with free ones: the free ones equal their solo run."""
    free = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["The capital of France is", "Once upon a time", "A product code: "]
    solo = [o.outputs[0].text for o in smollm2_llm.generate(prompts[:2], free, use_tqdm=False)]
    params = [free, free, SamplingParams(max_tokens=12, temperature=0.0,
                                         structured_outputs=StructuredOutputsParams(regex=r"\d{4}"))]
    got = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got[:2]] == solo
    assert re.fullmatch(r"\d{4}", got[2].outputs[0].text)


@pytest.mark.parametrize(
    "so, match",
    [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
         "json"),
        (StructuredOutputsParams(regex="(unclosed"), "regex"),
        (StructuredOutputsParams(grammar="root ::= missing_rule"), "grammar"),
    ],
)
def test_bad_constraint_is_value_error(smollm2_llm, so, match):
    with pytest.raises(ValueError, match=f"Invalid structured_outputs.{match}"):
        smollm2_llm.generate(["hi"], SamplingParams(structured_outputs=so), use_tqdm=False)
    core = smollm2_llm.llm_engine.core
    assert not core.requests  # nothing kept
    (o,) = smollm2_llm.generate(["The capital of France is"],
                                SamplingParams(max_tokens=4, temperature=0.0),
                                use_tqdm=False)[0].outputs
    assert o.text


def test_core_rejects_bad_grammar_at_add_request(smollm2_llm):
    """The core compiles again (a request from another process is not trusted)."""
    from pagedllm.engine.core_messages import EngineCoreRequest

    core = smollm2_llm.llm_engine.core
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[z-a]"))
    with pytest.raises(ValueError, match="regex"):
        core.add_request(EngineCoreRequest("bad-regex", [1, 2, 3], params, 0.0))
    assert "bad-regex" not in core.requests


def test_abort_frees_matcher(smollm2_llm):
    engine = smollm2_llm.llm_engine
    engine.add_request("so-abort", PROMPT, SamplingParams(
        max_tokens=50, n=2, temperature=1.0, structured_outputs=StructuredOutputsParams(json=PERSON)))
    engine.step()
    engine.step()
    state = engine.core.requests["so-abort"]
    seqs = list(state.seqs)
    assert all(s.grammar is not None for s in seqs)
    engine.abort_request("so-abort")
    assert "so-abort" not in engine.core.requests
    assert all(s.grammar is None for s in seqs)
    while engine.has_unfinished_requests():
        engine.step()


def test_allowed_token_ids(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    allowed = sorted({tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " ok")})
    (o,) = smollm2_llm.generate(["Answer:"], SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                                             allowed_token_ids=allowed),
                                use_tqdm=False)[0].outputs
    assert len(o.token_ids) == 6 and set(o.token_ids) <= set(allowed)


def test_bad_words(smollm2_llm):
    prompt = "The capital of France is"
    free = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0),
                                use_tqdm=False)[0].outputs[0].text
    assert "Paris" in free  # the test means something only if the model says it
    banned = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                           bad_words=["Paris"]),
                                  use_tqdm=False)[0].outputs[0].text
    assert "Paris" not in banned
