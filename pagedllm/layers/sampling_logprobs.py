"""Logprobs: the sampled token's raw logprob, its rank and the top-k of each row that asked
(`SamplerOutput`), and prompt logprobs. vLLM's default `raw_logprobs`: the log-softmax of the
model's logits before any processing. Apart from the sampling steps because it reads the raw
logits only and shapes what goes back to the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedllm.outputs import Logprob, make_logprob_dict


@dataclass
class SamplerOutput:
    """Per row: the sampled token and, for rows that asked for logprobs, its raw logprob, its
    rank in the vocabulary (1 = most likely) and the top-`num_logprobs` (token, logprob) list.
    Rows without logprobs have None there."""

    sampled_token_ids: list[int]
    sampled_logprobs: list[float | None]
    sampled_ranks: list[int | None]
    top_logprobs: list[list[tuple[int, float]] | None]

    def logprobs_dict(
        self, i: int, decode: Callable[[int], str] | None = None
    ) -> dict[int, Logprob] | None:
        """Row i's logprobs as vLLM's per-position `{token_id: Logprob}` (None if not asked)."""
        lp = self.sampled_logprobs[i]
        if lp is None:
            return None
        top = self.top_logprobs[i] or []
        return make_logprob_dict(self.sampled_token_ids[i], lp, self.sampled_ranks[i], top, decode)


def _gather_logprobs(
    sampled: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    num_logprobs: list[int | None],
    num_rows: int,
) -> SamplerOutput:
    token_ids = sampled.tolist()
    if raw_logprobs is None:
        none = [None] * num_rows
        return SamplerOutput(token_ids, list(none), list(none), list(none))
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (raw_logprobs >= sampled_lp).sum(dim=-1).tolist()
    sampled_lp_list = sampled_lp.squeeze(1).tolist()
    max_k = max(k for k in num_logprobs if k is not None)
    top_ids: list[list[int]] = [[] for _ in range(num_rows)]
    top_vals: list[list[float]] = [[] for _ in range(num_rows)]
    if max_k > 0:
        vals, ids = raw_logprobs.topk(min(max_k, raw_logprobs.shape[1]), dim=-1)
        top_ids, top_vals = ids.tolist(), vals.tolist()
    out_lp: list[float | None] = []
    out_rank: list[int | None] = []
    out_top: list[list[tuple[int, float]] | None] = []
    for i, k in enumerate(num_logprobs):
        if k is None:
            out_lp.append(None)
            out_rank.append(None)
            out_top.append(None)
        else:
            out_lp.append(sampled_lp_list[i])
            out_rank.append(ranks[i])
            out_top.append(list(zip(top_ids[i][:k], top_vals[i][:k])))
    return SamplerOutput(token_ids, out_lp, out_rank, out_top)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int], num_logprobs: int
) -> list[dict[int, Logprob]]:
    """Prompt logprobs from the logits of prompt positions: row j predicts `next_token_ids[j]`
    (the prompt token after position j). Returns one `{token_id: Logprob}` per row with that
    token's raw logprob and rank, plus the top-`num_logprobs` tokens. The engine prepends None
    for the first prompt token and fills `decoded_token`."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(
            f"got {logits.shape[0]} logits rows for {len(next_token_ids)} next tokens"
        )
    if not next_token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tok = torch.as_tensor(list(next_token_ids), dtype=torch.int64, device=logprobs.device)
    tok_lp = logprobs.gather(1, tok.unsqueeze(1))
    ranks = (logprobs >= tok_lp).sum(dim=-1).tolist()
    tok_lp_list = tok_lp.squeeze(1).tolist()
    if num_logprobs > 0:
        vals, ids = logprobs.topk(min(num_logprobs, logprobs.shape[1]), dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        top = [[] for _ in next_token_ids]
    return [
        make_logprob_dict(t, lp, r, tp)
        for t, lp, r, tp in zip(next_token_ids, tok_lp_list, ranks, top)
    ]
