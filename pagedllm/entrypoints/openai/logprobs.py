"""Log-probabilities in the OpenAI shapes.

Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry
per token; `top_logprobs[i]` maps token text to logprob for the requested top tokens plus the
sampled one (OpenAI: "up to logprobs+1 elements"); the first prompt token (echo) has None.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` where
`top_logprobs` are the `top_logprobs` most likely tokens in rank order.

-inf (a token masked out, e.g. by top-k) is not valid JSON: it is sent as -9999.0, as OpenAI
and vLLM do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pagedllm.entrypoints.openai.chat_protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
)
from pagedllm.entrypoints.openai.completion_protocol import CompletionLogProbs
from pagedllm.outputs import Logprob

_MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    if math.isnan(value):
        return _MIN_LOGPROB
    return max(value, _MIN_LOGPROB)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    token_text: Callable[[int], str],
    initial_text_offset: int = 0,
) -> CompletionLogProbs:
    """`logprobs[i]` is position i's {token_id: Logprob} (None for the first prompt token);
    `token_text(id)` is used where the engine gave no decoded text."""
    out = CompletionLogProbs()
    offset = initial_text_offset
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry.get(token_id) if entry is not None else None
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None \
            else token_text(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(json_logprob(chosen.logprob))
        top: dict[str, float] = {}
        for tid, lp in entry.items():
            key = lp.decoded_token if lp.decoded_token is not None else token_text(tid)
            top.setdefault(key, json_logprob(lp.logprob))
        out.top_logprobs.append(top)
    return out


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": json_logprob(logprob),
            "bytes": list(token.encode("utf-8"))}


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    num_top: int,
    token_text: Callable[[int], str],
) -> ChatCompletionLogProbs:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        text = chosen.decoded_token if chosen.decoded_token is not None else token_text(token_id)
        ranked = sorted(
            ((lp.rank, tid, lp) for tid, lp in entry.items()
             if lp.rank is not None and lp.rank <= num_top),
            key=lambda x: x[0],
        )
        tops = [
            ChatCompletionLogProb(**_chat_entry(
                lp.decoded_token if lp.decoded_token is not None else token_text(tid), lp.logprob))
            for _, tid, lp in ranked
        ]
        content.append(ChatCompletionLogProbsContent(**_chat_entry(text, chosen.logprob),
                                                     top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)
