"""The sampler's edits that only add to a row or forbid tokens: the token bitmask (structured
outputs, allowed_token_ids, bad_words), logit_bias and min_tokens (steps 0-2 of
layers/sampler.py's order). They commute, so their order is free; each is one batched op over
the rows that use it, and leaves the other rows bit-for-bit unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_NEG_INF = float("-inf")


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """-inf where a packed int32 bitmask row has a 0 bit, on `rows` of `logits` (all rows when
    None), in place: one unpack and one masked fill for the whole batch, any device. Tokens past
    the bitmask's width (a vocabulary padded beyond the tokenizer's) are disallowed."""
    vocab_size = logits.shape[1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    covered = min(vocab_size, bitmask.shape[1] * 32)
    xgr_apply = _xgrammar_apply()
    if xgr_apply is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        # xgrammar's kernel (CPU / CUDA): about 3x faster than the torch unpack below. Its
        # `indices` pick rows of the logits and of the bitmask alike: scatter ours to full size.
        if rows is not None:
            full = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
            full[torch.as_tensor(list(rows), device=bitmask.device)] = bitmask
            bitmask = full
        xgr_apply(logits, bitmask, vocab_size=covered,
                  indices=None if rows is None else list(rows))
        if covered < vocab_size:
            idx = slice(None) if rows is None else torch.as_tensor(list(rows), device=logits.device)
            logits[idx, covered:] = _NEG_INF
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = torch.bitwise_and(torch.bitwise_right_shift(bitmask.unsqueeze(-1), shifts), 1)
    allowed = allowed.view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:
        pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    allowed = allowed[:, :vocab_size]
    if rows is None:
        logits.masked_fill_(~allowed, _NEG_INF)
        return
    idx = torch.as_tensor(list(rows), dtype=torch.int64, device=logits.device)
    logits[idx] = logits.index_select(0, idx).masked_fill_(~allowed, _NEG_INF)


_XGR_APPLY: list = []


def _xgrammar_apply():
    """xgrammar's apply_token_bitmask_inplace, or None without xgrammar (the torch op runs)."""
    if not _XGR_APPLY:
        try:
            from xgrammar import apply_token_bitmask_inplace
        except ImportError:
            apply_token_bitmask_inplace = None
        _XGR_APPLY.append(apply_token_bitmask_inplace)
    return _XGR_APPLY[0]


def apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    rows, cols, vals = [], [], []
    vocab_size = logits.shape[1]
    for i, bias in enumerate(logit_bias):
        if not bias:
            continue
        for tok, b in bias.items():
            if not 0 <= tok < vocab_size:
                raise ValueError(
                    f"token_id(s) [{tok}] in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab_size}"
                )
            rows.append(i)
            cols.append(tok)
            vals.append(b)
    if rows:
        dev = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(vals, dtype=logits.dtype, device=dev),
            accumulate=True,
        )


def apply_min_tokens_mask(logits: torch.Tensor, masks: list[set[int] | None]) -> None:
    rows, cols = [], []
    vocab_size = logits.shape[1]
    for i, ids in enumerate(masks):
        if ids:
            for tok in ids:
                if 0 <= tok < vocab_size:
                    rows.append(i)
                    cols.append(tok)
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = _NEG_INF
