"""`deepseek_r1`, `qwen3` and `mistral`: reasoning between two tags (`<think>...</think>`,
Magistral's `[THINK]...[/THINK]`), the answer after it.

DeepSeek-R1's template opens `<think>` in the prompt, so the output may begin inside the
reasoning: everything up to `</think>` is reasoning, and an output that never closes it is all
reasoning (the model was still thinking). Qwen3 writes both tags itself and may skip thinking:
an output without `<think>` at its start is all content. Which of the two holds is read from
each request's rendered prompt (`for_prompt`: does it end with the opening tag?), so one parser
serves a template whether thinking is on or off (`enable_thinking`)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningSplit,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import partial_prefix_len

START = "<think>"
END = "</think>"
_WS = " \t\r\n"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    start, end = START, END
    start_required = False  # the prompt may have opened <think>

    def for_prompt(self, prompt_text: str) -> ReasoningParser:
        """This parser for a request whose prompt is `prompt_text`: the output starts inside
        the reasoning exactly when the prompt ends with the opening tag."""
        parser = type(self)()
        parser.start_required = not prompt_text.rstrip(_WS).endswith(self.start)
        return parser

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        start, end = self.start, self.end
        body = text.lstrip(_WS)
        if body.startswith(start):
            body = body[len(start):].lstrip(_WS)
        elif not finished and start.startswith(body):  # "" or a prefix of the tag: wait
            return ReasoningSplit(None, None)
        elif self.start_required:
            return ReasoningSplit(None, text)
        e = body.find(end)
        if e < 0:
            held = 0 if finished else partial_prefix_len(body, end)
            return ReasoningSplit(body[:len(body) - held], None)
        return ReasoningSplit(body[:e], body[e + len(end):].lstrip(_WS))


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    name = "qwen3"
    start_required = True


class MistralReasoningParser(DeepSeekR1ReasoningParser):
    """Magistral / Ministral 3 reasoning: `[THINK]...[/THINK]` (special tokens, kept in the text)."""

    name = "mistral"
    start, end = "[THINK]", "[/THINK]"
    start_required = True
    keeps_special_tokens = True
