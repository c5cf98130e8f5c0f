"""Each family's real chat template (tests/fixtures/chat_templates/): the tool-call parser
pagedllm reads from the template, and that parser reading back the calls the template itself
writes for an assistant turn (rendered by transformers' own renderer), in full and streamed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from pagedllm.entrypoints.openai.tool_calling import ToolConfig
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.detect import parser_for_template

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"

# template -> (parser read from it, the special tokens of its end of turn)
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", ["<|im_end|>"]),
    "Qwen-Qwen3-0.6B": ("hermes", ["<|im_end|>"]),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", ["<|im_end|>"]),
    "Qwen3-Coder": ("qwen3_coder", ["<|im_end|>"]),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", ["</s>"]),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral", ["</s>"]),
    "ibm-granite-granite-3.3-2B-Instruct": ("granite", None),  # writes no calls back: see below
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_v3", ["<｜end▁of▁sentence｜>"]),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3_json", ["<|eom_id|>", "<|eot_id|>"]),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3_json", ["<|eom_id|>", "<|eot_id|>"]),
    "google-gemma-2-2b-it": ("generic", []),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ARGS = {"city": "Paris", "days": 3}


def _render(template: str, messages: list[dict], generation_prompt: bool) -> str:
    rendered, _ = render_jinja_template([messages], tools=TOOLS, chat_template=template,
                                        add_generation_prompt=generation_prompt, bos_token="<s>", eos_token="</s>")
    return rendered[0]


def _assistant_turn(name: str, call_id: str) -> str:
    """What the template writes for an assistant turn holding one call (the rendering of the
    conversation with it, less the rendering up to the generation prompt)."""
    template = (TEMPLATES / f"{name}.jinja").read_text()
    user = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": "get_weather", "arguments": ARGS}}]}
    before = _render(template, user, True)
    full = _render(template, user + [call], False)
    assert full.startswith(before), "the template renders the prompt the same way with the reply"
    turn = full[len(before):]
    for stop in FAMILIES[name][1]:
        turn = turn.split(stop)[0]
    if "</think>" in turn:  # Qwen3's empty reasoning block: the reasoning parser takes it first
        turn = turn.split("</think>", 1)[1]
    return turn


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parser_read_from_the_real_template(name):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    expected = FAMILIES[name][0]
    assert (parser_for_template(template, set(TOOL_PARSERS)) or "generic") == expected
    assert ToolConfig().for_template(template, log=False).format == expected


@pytest.mark.parametrize("name", sorted(n for n, (p, stops) in FAMILIES.items() if stops))
def test_parser_reads_the_call_its_template_writes(name):
    parser = get_tool_parser(FAMILIES[name][0])
    parser.tools = [t["function"] for t in TOOLS]
    call_id = parser.make_id()
    turn = _assistant_turn(name, call_id)
    out = parser.extract_tool_calls(turn)
    assert out.tools_called, turn
    (call,) = out.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS, turn
    assert not out.content
    stream = parser.streamer()
    names, args = [], ""
    for k in range(1, len(turn) + 1):
        d = stream.feed(turn[:k], k == len(turn))
        assert not d.content.strip(), (turn[:k], d.content)
        names += [tc.name for tc in d.tool_calls if tc.name]
        args += "".join(tc.arguments for tc in d.tool_calls)
    assert names == ["get_weather"] and json.loads(args) == ARGS


@pytest.mark.parametrize("parser,text", [
    # what Granite 3.3's system prompt asks for (its template does not write calls back)
    ("granite", 'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),  # V3-0324 / R1
])
def test_model_written_calls(parser, text):
    out = get_tool_parser(parser).extract_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", ARGS)]
    assert out.content in (None, "Let me check.")


def test_mistral_ids_are_nine_alphanumerics_and_the_history_is_mapped():
    parser = get_tool_parser("mistral")
    assert len(parser.make_id()) == 9 and parser.make_id().isalnum()
    template = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                                   "function": {"name": "get_weather", "arguments": ARGS}}]},
               {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "22 C"}]
    with pytest.raises(Exception, match="alphanumeric"):  # the template's own refusal
        _render(template, history, True)
    mapped = parser.template_ids(history)
    assert mapped[1]["tool_calls"][0]["id"] == mapped[2]["tool_call_id"]  # call and result still pair
    assert parser.template_ids(history) == mapped  # the same every turn: the prefix cache holds
    assert "22 C" in _render(template, mapped, True)


@pytest.mark.parametrize("text,calls", [
    ('[get_weather(city="Paris", days=3), ping()]', [("get_weather", ARGS), ("ping", {})]),
    ('<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', [("get_weather", ARGS)]),
])
def test_pythonic_calls(text, calls):
    out = get_tool_parser("pythonic").extract_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    assert not get_tool_parser("pythonic").extract_tool_calls("[__import__('os').system('x')]").tools_called
    assert get_tool_parser("pythonic").extract_tool_calls("Plain answer.").content == "Plain answer."


@pytest.mark.parametrize("name,reasoning", [
    ("Qwen-Qwen3-0.6B", "qwen3"), ("deepseek-ai-DeepSeek-V3.1", "qwen3"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "qwen3"), ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral"),
    ("Qwen-Qwen2.5-7B-Instruct", None), ("google-gemma-2-2b-it", None),
])
def test_reasoning_parser_read_from_the_template(name, reasoning):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    assert ToolConfig().for_template(template, log=False).reasoning == reasoning
    assert ToolConfig(reasoning_parser="deepseek_r1").for_template(template, log=False).reasoning == "deepseek_r1"


def test_the_prompt_says_whether_the_output_starts_inside_the_reasoning():
    """A prompt that ends by opening <think> (DeepSeek-R1's first templates): the reply starts
    inside the reasoning; a prompt that closes it (this R1-Distill template as shipped, Qwen3
    with thinking off) or does not open it: a reply without the tag is all answer."""
    from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

    opened = get_reasoning_parser("qwen3").for_prompt("<｜User｜>2+2?<｜Assistant｜><think>\n")
    assert opened.extract_reasoning("Four, surely.</think>\n\nIt is 4.") == ("Four, surely.", "It is 4.")
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    prompt, _ = render_jinja_template([[{"role": "user", "content": "2+2?"}]], chat_template=template,
                                      add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert prompt[0].endswith("</think>")
    closed = get_reasoning_parser("deepseek_r1").for_prompt(prompt[0])
    assert closed.extract_reasoning("It is 4.") == (None, "It is 4.")
    magistral = get_reasoning_parser("mistral").for_prompt("[INST]2+2?[/INST]")
    assert magistral.keeps_special_tokens
    assert magistral.extract_reasoning("[THINK]Add.[/THINK]4") == ("Add.", "4")
