"""StructuredOutputsParams / allowed_token_ids / bad_words validation, the packed bitmask
helpers and the sampler's batched mask, without a model (a toy vocabulary)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.core_messages import EngineCoreRequest, decode_request, encode
from pagedllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from pagedllm.layers.sampling_masks import apply_token_bitmask
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams
from pagedllm.structured_output import (
    banned_tokens,
    check_constraint,
    choice_grammar,
    clear_token_bits,
    pack_token_ids,
    unpack_bitmask,
)

xgr = pytest.importorskip("xgrammar")


# ---- params -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": {"type": "object"}, "regex": "a+"}, {"choice": ["a"], "grammar": "root ::= \"a\""}],
)
def test_exactly_one_constraint(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": 3}, "JSON schema"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
        ({"structural_tag": 5}, "dict or a JSON string"),
    ],
)
def test_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_kind_and_cache_key():
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json={"a": 2, "b": 1})
    assert a.kind == "json" and a.cache_key() == b.cache_key()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(json_object=False, regex="x").kind == "regex"


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams.from_dict({"regex": "a", "whitespace_pattern": " "})
    assert StructuredOutputsParams.from_dict({"choice": ["x", "y"]}).choice == ["x", "y"]


def test_sampling_params_fields():
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"}, allowed_token_ids=[5, 3, 5],
                       bad_words="foo")
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    assert p.allowed_token_ids == [3, 5]
    assert p.bad_words == ["foo"]
    assert p.clone().structured_outputs == p.structured_outputs


def test_beam_search_refused():
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                       structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, bad_words=["a"])


@pytest.mark.parametrize("ids, match", [([], "empty"), ([-1], "non-negative"), (["a"], "token ids")])
def test_allowed_token_ids_checked(ids, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(allowed_token_ids=ids)


def test_verify_token_ids_checks_vocab_and_check_constraint_the_grammar():
    """verify_token_ids no longer parses grammars (that ran on the event loop): the server
    checks them on a thread of their own (AsyncLLMEngine._check_constraint) and the core's
    compiler process compiles them within a time limit."""
    with pytest.raises(ValueError, match="out of vocabulary"):
        SamplingParams(allowed_token_ids=[1, 100]).verify_token_ids(50)
    SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab")).verify_token_ids(50)
    with pytest.raises(ValueError, match=r"Invalid structured_outputs\.regex.*parenthesis"):
        check_constraint(StructuredOutputsParams(regex="(ab"))
    with pytest.raises(ValueError, match=r"Invalid structured_outputs\.json.*foo"):
        check_constraint(StructuredOutputsParams(json={"type": "foo"}))
    with pytest.raises(ValueError, match=r"Invalid structured_outputs\.grammar.*nope"):
        check_constraint(StructuredOutputsParams(grammar="root ::= nope"))


def test_valid_constraints_pass_check():
    for so in (
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d+"),
        StructuredOutputsParams(choice=['say "hi"', "a\\b"]),
        StructuredOutputsParams(grammar='root ::= "x" [0-9]*'),
        StructuredOutputsParams(structural_tag={
            "type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}),
    ):
        check_constraint(so)


def test_choice_grammar_escapes():
    g = xgr.Grammar.from_ebnf(choice_grammar(['a"b', "c\\d"]))
    assert 'a\\"b' in str(g)


def test_fields_travel_over_msgspec():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"},
                                                                       disable_any_whitespace=True),
                            allowed_token_ids=[4, 2], bad_words=["x y"])
    got = decode_request(encode(EngineCoreRequest("r", [1], params, 0.0))).sampling_params
    assert got.structured_outputs == params.structured_outputs
    assert got.allowed_token_ids == [2, 4] and got.bad_words == ["x y"]


# ---- bitmask helpers ----------------------------------------------------------------------


def test_pack_unpack_roundtrip():
    ids = [0, 1, 31, 32, 63, 64, 99]
    row = pack_token_ids(ids, 100)
    assert row.dtype == torch.int32 and row.shape == (4,)
    allowed = unpack_bitmask(row.unsqueeze(0), 100)[0]
    assert allowed.nonzero().squeeze(1).tolist() == ids
    # The same packing as xgrammar's own bitmask (bit t of word t // 32).
    ref = xgr.allocate_token_bitmask(1, 100)
    ref.zero_()
    for t in ids:
        ref[0, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    assert torch.equal(ref[0], row)


def test_clear_token_bits():
    row = torch.full((2,), -1, dtype=torch.int32)
    clear_token_bits(row, [0, 31, 33])
    allowed = unpack_bitmask(row.unsqueeze(0), 64)[0]
    assert sorted(set(range(64)) - set(allowed.nonzero().squeeze(1).tolist())) == [0, 31, 33]


def test_banned_tokens():
    words = [[7], [1, 2, 3], [4, 5]]
    assert banned_tokens(words, []) == [7]
    assert banned_tokens(words, [9, 1, 2]) == [7, 3]
    assert banned_tokens(words, [1, 2, 4]) == [7, 5]
    assert banned_tokens(words, [2, 1]) == [7]


def test_apply_token_bitmask_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    before = logits.clone()
    mask = torch.stack([pack_token_ids([5, 69], 70), pack_token_ids([0], 70)])
    apply_token_bitmask(logits, mask, rows=[0, 2])
    assert torch.equal(logits[1], before[1])  # unconstrained row untouched
    assert torch.isfinite(logits[0]).nonzero().squeeze(1).tolist() == [5, 69]
    assert torch.isfinite(logits[2]).nonzero().squeeze(1).tolist() == [0]
    assert logits[0, 5] == before[0, 5]


def test_apply_token_bitmask_torch_and_xgrammar_agree(monkeypatch):
    import pagedllm.layers.sampling_masks as masks_mod

    torch.manual_seed(1)
    logits = torch.randn(5, 100)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32)
    fast = logits.clone()
    apply_token_bitmask(fast, bitmask, rows=[0, 2, 4])
    monkeypatch.setattr(masks_mod, "_XGR_APPLY", [None])  # the torch op
    slow = logits.clone()
    apply_token_bitmask(slow, bitmask, rows=[0, 2, 4])
    assert torch.equal(fast, slow)
    assert torch.equal(fast[1], logits[1]) and torch.equal(fast[3], logits[3])


@pytest.mark.parametrize("torch_path", [False, True])
def test_apply_token_bitmask_padded_vocab_is_masked(monkeypatch, torch_path):
    import pagedllm.layers.sampling_masks as masks_mod

    if torch_path:
        monkeypatch.setattr(masks_mod, "_XGR_APPLY", [None])
    logits = torch.zeros(1, 40)
    apply_token_bitmask(logits, torch.full((1, 1), -1, dtype=torch.int32))  # covers 32 ids
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_honours_bitmask(temperature):
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    logits[:, 10] = 50.0  # the unconstrained favourite
    params = SamplingParams(temperature=temperature, seed=3)
    rows = [SamplingRow(params, [1], [], torch.Generator().manual_seed(i)) for i in range(4)]
    md = SamplingMetadata.build(rows)
    md.token_bitmask = torch.stack([pack_token_ids([20, 21], 64), pack_token_ids([33], 64)])
    md.bitmask_rows = [1, 3]
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[0] == 10 and out.sampled_token_ids[2] == 10
    assert out.sampled_token_ids[1] in (20, 21) and out.sampled_token_ids[3] == 33


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_nested_too_deeply_is_refused_before_xgrammar_parses_it():
    """xgrammar's parse is about cubic in the depth (900 levels: 35 s on the server's
    constraint-check thread); a depth bound refuses such a schema at once, as a dict or as a
    JSON string (a 5,000-deep string used to be a 500 RecursionError)."""
    import json

    ok = StructuredOutputsParams(json=_deep_schema(60))  # 121 levels of objects
    check_constraint(ok)
    with pytest.raises(ValueError, match="nested too deeply: 129 levels.*at most 128"):
        StructuredOutputsParams(json=_deep_schema(64))
    text = "{" + '"a":{' * 4999 + "}" * 5000
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutputsParams(json=text)
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutputsParams(json=json.dumps(_deep_schema(300)))
