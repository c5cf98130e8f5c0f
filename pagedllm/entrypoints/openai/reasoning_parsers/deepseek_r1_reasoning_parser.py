"""`deepseek_r1` and `qwen3`: reasoning in `<think>...</think>`, the answer after it.

DeepSeek-R1's template opens `<think>` in the prompt, so the output may begin inside the
reasoning: everything up to `</think>` is reasoning, and an output that never closes it is all
reasoning (the model was still thinking). Qwen3 writes both tags itself and may skip thinking:
an output without `<think>` at its start is all content."""

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
    start_required = False  # the prompt may have opened <think>

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        body = text.lstrip(_WS)
        if body.startswith(START):
            body = body[len(START):].lstrip(_WS)
        elif not finished and START.startswith(body):  # "" or a prefix of <think>: wait
            return ReasoningSplit(None, None)
        elif self.start_required:
            return ReasoningSplit(None, text)
        e = body.find(END)
        if e < 0:
            held = 0 if finished else partial_prefix_len(body, END)
            return ReasoningSplit(body[:len(body) - held], None)
        return ReasoningSplit(body[:e], body[e + len(END):].lstrip(_WS))


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    name = "qwen3"
    start_required = True
