"""Tool-call and reasoning parsers: full extraction, streaming (fed one character at a time,
the deltas must add up to the full result), malformed output left as content, the schemas that
force "required" / named calls, and the request-level plan (which mode, which 400)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import check_constraint
from pagedllm.entrypoints.openai.tool_calling import (
    ToolConfig,
    finish_reason,
    plan_tools,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    get_tool_parser,
    named_tool_schema,
    required_tool_schema,
)

# What Qwen2.5-7B-Instruct writes for two calls (its chat template's format), with a preamble.
QWEN_TWO_CALLS = (
    "Let me look both up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
# Llama-3.1-8B-Instruct's JSON tool call (its template asks for "parameters").
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "days": 3}}'


def stream(parser, text: str, step: int = 1):
    """Feed the text in `step`-character pieces; (content, {index: (id, name, args)})."""
    s = parser.streamer()
    content = ""
    calls: dict[int, list] = {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for k in cuts:
        d = s.feed(text[:k], k == len(text))
        content += d.content
        assert len({tc.index for tc in d.tool_calls}) == len(d.tool_calls), "one entry a call"
        for tc in d.tool_calls:
            if tc.id is not None:
                assert tc.index not in calls and (tc.arguments == "" or k == len(text))
                calls[tc.index] = [tc.id, tc.name, tc.arguments]
            else:
                assert tc.index in calls, "arguments only after the call's first delta"
                calls[tc.index][2] += tc.arguments
    return content, calls


def assert_stream_equals_full(parser, text: str) -> None:
    full = parser.extract_tool_calls(text)
    for step in (1, 3, 7):
        content, calls = stream(parser, text, step)
        assert content == (full.content or "")
        assert [(c[1], c[2]) for c in calls.values()] == [
            (f.name, f.arguments) for f in full.tool_calls]
        assert all(c[0].startswith("call_") for c in calls.values())


# --------------------------------------------------------------------------------- hermes


def test_hermes_full():
    out = get_tool_parser("hermes").extract_tool_calls(QWEN_TWO_CALLS)
    assert out.tools_called and out.content == "Let me look both up."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]


@pytest.mark.parametrize("text", [
    QWEN_TWO_CALLS,
    '<tool_call>\n{"name": "f", "arguments": {"s": "a}\\"{<tool_call>"}}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}}',  # stopped before the closing tag
    'No tools needed: 2 + 2 = 4. <tool_',
])
def test_hermes_stream_equals_full(text):
    assert_stream_equals_full(get_tool_parser("hermes"), text)


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",  # missing }
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\nnot json\n</tool_call>",
])
def test_hermes_malformed_is_content(text):
    p = get_tool_parser("hermes")
    out = p.extract_tool_calls(text)
    assert not out.tools_called and out.tool_calls == [] and out.content == text
    content, calls = stream(p, text)
    if not calls:  # nothing was announced: the whole text comes out as content
        assert content == text


def test_hermes_holds_back_a_partial_tag():
    s = get_tool_parser("hermes").streamer()
    assert s.feed("Sure <tool", False).content == "Sure"
    d = s.feed('Sure <tool_call>{"name": "f"', False)
    assert d.content == "" and d.tool_calls[0].name == "f"


def test_plain_text_has_no_calls():
    for name in ("hermes", "llama3_json"):
        out = get_tool_parser(name).extract_tool_calls("  Hello there.  ")
        assert not out.tools_called and out.content == "Hello there."


# ---------------------------------------------------------------------------- llama3_json


def test_llama3_json_full():
    p = get_tool_parser("llama3_json")
    out = p.extract_tool_calls(LLAMA_CALL)
    assert out.tools_called and out.content is None
    (c,) = out.tool_calls
    assert c.name == "get_weather" and json.loads(c.arguments) == {"city": "San Francisco, CA",
                                                                  "days": 3}
    two = p.extract_tool_calls('<|python_tag|>{"name": "a", "arguments": {"x": [1, {"y": 2}]}}; '
                               '{"name": "b", "parameters": {}}')
    assert [(c.name, c.arguments) for c in two.tool_calls] == [("a", '{"x": [1, {"y": 2}]}'),
                                                               ("b", "{}")]


@pytest.mark.parametrize("text", [
    LLAMA_CALL,
    '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "parameters": {}}',
    "The answer is 42.",
])
def test_llama3_json_stream_equals_full(text):
    assert_stream_equals_full(get_tool_parser("llama3_json"), text)


def test_a_call_cut_short_after_its_name_was_streamed():
    """Too late to take the call back: it stays, the full parse says content."""
    text = '{"name": "f", "parameters": {"a": 1}'
    p = get_tool_parser("llama3_json")
    content, calls = stream(p, text)
    assert content == "" and [(c[1], c[2]) for c in calls.values()] == [("f", '{"a": 1}')]
    assert p.extract_tool_calls(text).content == text


def test_llama3_json_malformed_is_content():
    p = get_tool_parser("llama3_json")
    for text in ('{"name": "f", "parameters": {"a": 1}', '{"name": 3, "parameters": {}}',
                 '{"name": "f", "parameters": {}} and then prose'):
        out = p.extract_tool_calls(text)
        assert not out.tools_called and out.content == text


def test_unknown_parser_names_the_known():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


# ------------------------------------------------------------------- forced: schema, parse

WEATHER = {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"], "$defs": {"unit": {"enum": ["c", "f"]}}}}
NOARGS = {"name": "ping"}


def test_required_schema_validates_calls():
    schema = required_tool_schema([WEATHER, NOARGS])
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}},
          {"name": "ping", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"unit": "c"}}],
                [{"name": "get_weather", "parameters": {"city": "P", "unit": "k"}}],
                [{"name": "other", "parameters": {}}], [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert schema["$defs"] == {"unit": {"enum": ["c", "f"]}}
    single = required_tool_schema([WEATHER], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[:1] * 2, single)


def test_required_schema_conflicting_defs():
    other = {"name": "g", "parameters": {"type": "object", "$defs": {"unit": {"type": "string"}}}}
    with pytest.raises(ValueError, match="unit"):
        required_tool_schema([WEATHER, other])


def test_named_schema():
    assert named_tool_schema(WEATHER) is WEATHER["parameters"]
    assert named_tool_schema(NOARGS) == {"type": "object", "properties": {}}


def test_required_parser():
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris"}},\n '
            '{"parameters": {}, "name": "ping"}]')
    p = RequiredToolParser()
    out = p.extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("ping", "{}")]
    assert out.content is None
    assert_stream_equals_full(p, text)
    assert not p.extract_tool_calls('[{"name": "get_weather", "parameters": {"ci').tools_called


def test_named_parser():
    p = NamedToolParser("get_weather")
    text = '{\n  "city": "Paris"\n}'
    out = p.extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", text)]
    assert_stream_equals_full(p, text)
    assert not p.extract_tool_calls('{"city": "Par').tools_called


# ------------------------------------------------------------------------------ reasoning


def test_deepseek_r1():
    p = get_reasoning_parser("deepseek_r1")
    assert p.extract_reasoning("<think>\nLet me see.</think>\n\nIt is 4.") == ("Let me see.",
                                                                              "It is 4.")
    assert p.extract_reasoning("Let me see.</think>It is 4.") == ("Let me see.", "It is 4.")
    assert p.extract_reasoning("still thinking") == ("still thinking", None)
    q = get_reasoning_parser("qwen3")
    assert q.extract_reasoning("It is 4.") == (None, "It is 4.")
    assert q.extract_reasoning("<think>hm</think>It is 4.") == ("hm", "It is 4.")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", ["<think>\nOk, 2+2.\n</think>\n\nFour.", "Ok.</think>Four",
                                  "<think>never closed </thin", "Four."])
def test_reasoning_stream_equals_full(name, text):
    p = get_reasoning_parser(name)
    s = p.streamer()
    reasoning = ""
    for k in range(1, len(text) + 1):
        delta, content = s.feed(text[:k], k == len(text))
        reasoning += delta
    full_reasoning, full_content = p.extract_reasoning(text)
    assert reasoning == (full_reasoning or "") and content == (full_content or "")


# ----------------------------------------------------------------------- the request plan

TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": NOARGS}]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_tool_choice_defaults_and_checks():
    assert request().tool_choice == "none"
    assert request(tools=TOOLS).tool_choice == "auto"
    with pytest.raises(ValueError, match="`tools` must be set"):
        request(tool_choice="required")
    with pytest.raises(ValueError, match="does not match"):
        request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_plan_modes():
    generic, auto = ToolConfig(), ToolConfig(True, "hermes")
    plan = plan_tools(request(tools=TOOLS), generic)  # no flags, no tool template: generic mode
    assert plan.tool_parser.name == "generic" and "anyOf" in plan.schema  # an answer or calls
    assert plan.apply(SamplingParams()).structured_outputs.disable_any_whitespace
    assert plan_tools(request(tools=TOOLS, tool_choice="none"), generic).tool_parser is None
    assert plan_tools(request(tools=TOOLS), auto).tool_parser.name == "hermes"
    assert plan_tools(request(tools=TOOLS), auto).schema is None  # free text, parsed
    req = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), auto)
    assert req.schema["maxItems"] == 1 and req.tool_parser.name == "required"
    named = plan_tools(request(tools=TOOLS, tool_choice={"type": "function",
                                                          "function": {"name": "ping"}}), auto)
    assert named.schema == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True)
    any_ws = ToolConfig(any_whitespace=True)
    assert not plan_tools(request(tools=TOOLS), any_ws).apply(SamplingParams()).structured_outputs.disable_any_whitespace


def test_strict_tools_under_auto_get_the_formats_structural_tag():
    strict = [{"type": "function", "function": {**WEATHER, "strict": True}}]
    plan = plan_tools(request(tools=strict), ToolConfig(tool_call_parser="hermes"))
    tag = plan.structural_tag["format"]
    assert tag["triggers"] == ["<tool_call>"]
    assert tag["tags"][0]["content"]["json_schema"] == WEATHER["parameters"]
    so = plan.apply(SamplingParams()).structured_outputs
    assert so.kind == "structural_tag"
    check_constraint(so)  # xgrammar takes it
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string
    grammar = Grammar.from_structural_tag(json.dumps(plan.structural_tag))
    call = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'
    assert _is_grammar_accept_string(grammar, "Free text first. " + call % '{"city": "Paris", "unit": "c"}')
    assert _is_grammar_accept_string(grammar, "No call at all.")  # a turn without a call stays free
    assert not _is_grammar_accept_string(grammar, call % '{"city": 3}')  # the schema holds in the call
    assert not _is_grammar_accept_string(grammar, call.replace("get_weather", "other") % "{}")


def test_choice_parser_reasoning_then_tools():
    plan = plan_tools(request(tools=TOOLS), ToolConfig(True, "hermes", "deepseek_r1"))
    text = "<think>Need weather.</think>\n" + QWEN_TWO_CALLS
    full = plan.choice_parser().full(text)
    assert full.reasoning_content == "Need weather." and full.content == "Let me look both up."
    assert [c.function.name for c in full.tool_calls] == ["get_weather", "get_time"]
    p = plan.choice_parser()
    reasoning, content, args = "", "", {}
    for k in range(1, len(text) + 1):
        d = p.delta(text[:k], k == len(text))
        reasoning += d.reasoning_content
        content += d.content
        for tc in d.tool_calls:
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert (reasoning, content) == ("Need weather.", "Let me look both up.")
    assert list(args.values()) == [c.function.arguments for c in full.tool_calls]
    assert p.tools_called and finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"


def test_no_parallel_keeps_the_first_call():
    plan = plan_tools(request(tools=TOOLS, parallel_tool_calls=False), ToolConfig(True, "hermes"))
    assert [c.function.name for c in plan.choice_parser().full(QWEN_TWO_CALLS).tool_calls] == [
        "get_weather"]


def test_forced_output_skips_the_reasoning_parser():
    plan = plan_tools(request(tools=TOOLS, tool_choice="required"),
                      ToolConfig(tool_call_parser="hermes", reasoning_parser="deepseek_r1"))
    out = plan.choice_parser().full('[{"name": "ping", "parameters": {}}]')
    assert out.reasoning_content is None and out.tool_calls[0].function.name == "ping"


def test_template_messages_keep_tool_calls():
    req = ChatCompletionRequest(tools=TOOLS, tool_choice="none", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ])
    conv = req.conversation()
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conv[1]["content"] == "" and conv[2]["tool_call_id"] == "call_1"
    assert req.template_tools()[0]["function"]["name"] == "get_weather"
    bad = ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(ValueError, match="not valid JSON"):
        bad.conversation()


# --------------------------------------------------------------- generic mode, detection, cuts

def test_generic_envelope_schema_parse_and_stream():
    from pagedllm.entrypoints.openai.tool_parsers.generic import generic_schema
    schema = generic_schema([WEATHER, NOARGS])
    jsonschema.Draft202012Validator.check_schema(schema)
    calls = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
                            {"name": "ping", "arguments": {}}]}
    jsonschema.validate(calls, schema)
    jsonschema.validate({"response": "Hello"}, schema)
    for bad in ({"tool_calls": []}, {"response": 3}, {"tool_calls": [{"name": "get_weather", "arguments": {"unit": "x"}}]},
                {"response": "a", "tool_calls": []}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert generic_schema([WEATHER], parallel=False)["anyOf"][0]["properties"]["tool_calls"]["maxItems"] == 1
    assert "anyOf" not in generic_schema([WEATHER], answer=False)  # "required": calls only

    parser = get_tool_parser("generic")
    text = json.dumps(calls)
    full = parser.extract_tool_calls(text)
    assert full.content is None and [c.name for c in full.tool_calls] == ["get_weather", "ping"]
    assert json.loads(full.tool_calls[0].arguments) == {"city": "Paris", "unit": "c"}
    content, args = stream(parser, text)
    assert content == "" and [a[1:] for a in args.values()] == [[c.name, c.arguments] for c in full.tool_calls]
    answer = json.dumps({"response": 'Line "one"\nand \u00e9 \u2603'})
    assert parser.extract_tool_calls(answer).content == 'Line "one"\nand \u00e9 \u2603'
    assert parser.extract_tool_calls(answer).tool_calls == []
    content, args = stream(parser, answer)  # streamed as the string grows, escapes whole
    assert content == 'Line "one"\nand \u00e9 \u2603' and not args


def test_generic_conversation_rewrites_calls_and_results():
    from pagedllm.entrypoints.openai.tool_parsers.generic import generic_conversation
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    out = generic_conversation(messages, [WEATHER])
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(out[3]["content"]) == {"tool_response": {"name": "get_weather", "content": "22 C"}}
    with_system = generic_conversation([{"role": "system", "content": "Be brief."}, *messages[:1]], [WEATHER])
    assert len(with_system) == 2 and with_system[0]["content"].startswith("Be brief.\n\n")


def test_parser_read_from_the_template():
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from pagedllm.entrypoints.openai.tool_parsers.detect import parser_for_template, template_takes_tools
    from tests.server.tool_templates import QWEN25_TOOL_TEMPLATE
    smollm2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
               "+ '<|im_end|>\\n'}}{% endfor %}")
    assert template_takes_tools(QWEN25_TOOL_TEMPLATE) and not template_takes_tools(smollm2)
    assert parser_for_template(QWEN25_TOOL_TEMPLATE, set(TOOL_PARSERS)) == "hermes"
    assert parser_for_template(smollm2, set(TOOL_PARSERS)) is None
    llama31 = ('{%- if tools %}{{ tools | tojson }}{% endif %}{%- for m in messages %}{%- if m.tool_calls %}'
               '{{- \'{"name": "\' + m.tool_calls[0].function.name + \'", "parameters": \' }}{% endif %}{% endfor %}')
    assert parser_for_template(llama31, set(TOOL_PARSERS)) == "llama3_json"
    assert ToolConfig().for_template(smollm2).format == "generic"
    assert ToolConfig().for_template(QWEN25_TOOL_TEMPLATE).format == "hermes"
    assert ToolConfig(tool_call_parser="generic").for_template(QWEN25_TOOL_TEMPLATE).format == "generic"


@pytest.mark.parametrize("name,cut", [
    ("required", '[{"name": "ping", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Pa'),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_w'),
    ("generic", '{"tool_calls": [{"name": "ping", "arguments": {}}, {"name": "get_weather", "arguments": {"ci'),
])
def test_a_cut_reply_keeps_its_complete_calls(name, cut):
    """max_tokens cut the second call: the first is a call, the cut one is dropped, no JSON text."""
    parser = RequiredToolParser() if name == "required" else get_tool_parser(name)
    out = parser.extract_tool_calls(cut, truncated=True)
    assert [c.name for c in out.tool_calls] == ["ping"] and out.tool_calls[0].arguments == "{}"
    assert out.content == ("Sure." if name == "hermes" else None)
    assert not parser.extract_tool_calls(cut).tools_called  # not cut by the budget: malformed, text
    s = parser.streamer()
    names = []
    for k in range(1, len(cut) + 1):
        d = s.feed(cut[:k], k == len(cut), truncated=k == len(cut))
        names += [tc.name for tc in d.tool_calls if tc.name]
    assert names[0] == "ping"


@pytest.mark.parametrize("tools,param", [
    ([{"type": "function", "function": {"name": "x" * 100_000}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)], "tools"),
    ([{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5001)}}}}],
     "tools[0].function.parameters"),
])
def test_hostile_tools_are_refused_by_field(tools, param):
    with pytest.raises(OpenAIError) as e:
        plan_tools(request(tools=tools), ToolConfig())
    assert e.value.status == 400 and e.value.param == param
    assert len(str(e.value)) < 400  # a 100 kB name is not echoed back


def test_parallel_tool_calls_unset_means_one_call_where_the_grammar_writes_them():
    hermes = ToolConfig(tool_call_parser="hermes")
    assert plan_tools(request(tools=TOOLS), hermes).parallel  # the model's own format: several
    assert not plan_tools(request(tools=TOOLS, tool_choice="required"), hermes).parallel
    assert plan_tools(request(tools=TOOLS, tool_choice="required"), hermes).schema["maxItems"] == 1
    assert not plan_tools(request(tools=TOOLS), ToolConfig()).parallel  # generic mode
    assert plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=True), hermes).parallel
