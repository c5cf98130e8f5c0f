"""The sampler: logits rows in, one token per row out (plus logprobs), vLLM v1 semantics.

Per row, in this order:
  0. the token bitmask (structured outputs, allowed_token_ids, bad_words: pagedllm/
     structured_output) sets the logits of disallowed tokens to -inf, for all constrained rows in
     one op;
  1. logit_bias is added;
  2. min_tokens: EOS and stop token ids get -inf while the row has fewer than min_tokens outputs;
  3. penalties: repetition (prompt + output tokens: positive logits divided, negative multiplied),
     frequency (count in the output × penalty subtracted), presence (penalty subtracted once for
     every token present in the output);
  4. greedy rows (temperature < 1e-5) take the argmax of these logits; the others go on with
  5. temperature, min-p, top-k, top-p, and sample from the softmax with the exponential race
     `argmax(probs / q)`, `q ~ Exp(1)`, which draws exactly from `probs`.

This is vLLM v1's documented order (vllm/v1/sample/sampler.py: allowed token ids, bad words,
min_tokens and logit_bias, penalties, greedy, temperature, the argmax-invariant min-p, then
top-k / top-p). One difference that changes no result: the bitmask, logit_bias and min_tokens
commute (each adds to a row or sets -inf), so their order is free.

Seeded rows draw their `q` from their own `torch.Generator`, so the token depends only on the
seed, the number of steps so far and the row's logits, never on the other rows of the batch;
every step above works row by row, and a row whose knob is off is left bit-for-bit unchanged.

Logprobs are vLLM's default `raw_logprobs`: the log-softmax of the model's logits before any of
the processing above. They are computed only when some row asks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedllm.kernels import fused_ops_kernel
from pagedllm.outputs import Logprob, make_logprob_dict
from pagedllm.sampling_params import _SAMPLING_EPS, SamplingParams

_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for a seeded sequence. One on the logits' device is fastest; a CPU
    generator also works with GPU logits (its draws are copied over), and then a seed gives the
    same draws on every device.

    For n > 1 with a seed, give sample i the seed `seed + i` (vLLM's choice) so that the samples
    differ but stay reproducible."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as `argmax`; a row with a NaN: its first
    NaN, as torch's `max`). Float32 rows on CPU go through kernels/fused_ops.c's
    `argmax_rows_f32` (256 x 49,152: 10.4 ms a step with torch's `max(dim)` on a 2-core Xeon);
    elsewhere `max(dim).indices`, because torch's CPU `argmax` over a row of a vocabulary is 4x
    slower than its `max` with indices (15.7 vs 3.8 ms on the 2-core Zen5; benchmarks/profile_step)."""
    if (x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0 and x.stride(1) == 1 and x.stride(0) >= x.shape[1]
            and x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()):
        kernel = fused_ops_kernel()
        if kernel is not None:
            out = torch.empty(x.shape[0], dtype=torch.int64)
            kernel.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                               torch.get_num_threads())
            return out
    return x.max(dim=-1).indices


@dataclass
class SamplingRow:
    """What the engine knows about one logits row; `SamplingMetadata.build` turns a list of
    these into the batched metadata. `generator` is the sequence's own (see make_generator),
    kept across steps; None for unseeded rows."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    penalty_counts: PenaltyCounts | None = None  # the sequence's own, kept across steps


@dataclass
class SamplingMetadata:
    """Sampling inputs for one step, one entry per logits row."""

    temperatures: torch.Tensor  # [R] float32; 0 for greedy rows
    top_ps: torch.Tensor  # [R] float32; 1.0 = off
    top_ks: torch.Tensor  # [R] int64; 0 = off
    min_ps: torch.Tensor  # [R] float32; 0.0 = off
    presence_penalties: torch.Tensor  # [R] float32
    frequency_penalties: torch.Tensor  # [R] float32
    repetition_penalties: torch.Tensor  # [R] float32
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    logit_bias: list[dict[int, float] | None]
    # Token ids forbidden in rows that have not reached min_tokens yet (EOS + stop ids).
    min_tokens_mask: list[set[int] | None]
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    # Packed allowed-token bits ([K, ceil(V/32)] int32, bit t of a row set = token t allowed)
    # for the K rows `bitmask_rows` of the batch; None: no row is constrained.
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None
    # Per row, the sequence's kept penalty statistics (None: counted from the lists this step).
    penalty_counts: list[PenaltyCounts | None] | None = None

    @property
    def no_top_k_top_p_min_p(self) -> bool:
        return self.no_top_k and self.no_top_p and self.no_min_p

    @property
    def max_num_logprobs(self) -> int | None:
        ks = [k for k in self.num_logprobs if k is not None]
        return max(ks) if ks else None

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        eos_token_id: int | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Batches per-row inputs (tensors on `device`, the logits' device).

        min_tokens: a row whose output is shorter than `params.min_tokens` gets its stop token
        ids, `params.all_stop_token_ids` (EOS ids added by update_from_generation_config) and
        `eos_token_id` blocked (also with ignore_eos, as vLLM: then EOS is merely not produced
        before min_tokens)."""
        temps, top_ps, top_ks, min_ps, pres, freq, rep = [], [], [], [], [], [], []
        min_tokens_mask: list[set[int] | None] = []
        for r in rows:
            p = r.params
            temps.append(0.0 if p.temperature < _SAMPLING_EPS else p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(p.top_k)
            min_ps.append(p.min_p)
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            rep.append(p.repetition_penalty)
            if len(r.output_token_ids) < p.min_tokens:
                blocked = set(p.all_stop_token_ids) | set(p.stop_token_ids)
                if eos_token_id is not None:
                    blocked.add(eos_token_id)
                min_tokens_mask.append(blocked or None)
            else:
                min_tokens_mask.append(None)

        def f32(xs: list[float]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.float32, device=device)

        return cls(
            temperatures=f32(temps),
            top_ps=f32(top_ps),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=f32(min_ps),
            presence_penalties=f32(pres),
            frequency_penalties=f32(freq),
            repetition_penalties=f32(rep),
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[r.output_token_ids for r in rows],
            generators=[r.generator for r in rows],
            penalty_counts=[r.penalty_counts for r in rows],
            num_logprobs=[r.params.logprobs for r in rows],
            logit_bias=[r.params.logit_bias or None for r in rows],
            min_tokens_mask=min_tokens_mask,
            all_greedy=all(t == 0.0 for t in temps),
            all_random=all(t != 0.0 for t in temps),
            no_penalties=all(a == 0.0 for a in pres)
            and all(b == 0.0 for b in freq)
            and all(c == 1.0 for c in rep),
            no_top_k=all(k <= 0 for k in top_ks),
            no_top_p=all(p >= 1.0 for p in top_ps),
            no_min_p=all(m <= 0.0 for m in min_ps),
        )


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


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [R, V] (any float dtype; processed in float32). The input is not modified."""
        num_rows = logits.shape[0]
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        needs_edit = (
            metadata.token_bitmask is not None
            or any(b is not None for b in metadata.logit_bias)
            or any(m is not None for m in metadata.min_tokens_mask)
            or not metadata.no_penalties
        )
        if needs_edit or not metadata.all_greedy:
            logits = logits.clone()  # processed in place from here on
        if needs_edit:
            if metadata.token_bitmask is not None:
                apply_token_bitmask(logits, metadata.token_bitmask, metadata.bitmask_rows)
            apply_logit_bias(logits, metadata.logit_bias)
            apply_min_tokens_mask(logits, metadata.min_tokens_mask)
            if not metadata.no_penalties:
                apply_penalties(logits, metadata)

        if metadata.all_greedy:
            sampled = argmax_rows(logits)
        else:
            sampled = self._sample(logits, metadata)

        return _gather_logprobs(sampled, raw_logprobs, metadata.num_logprobs, num_rows)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_random:
            return random_sample(
                logits, md.temperatures, md.top_ks, md.top_ps, md.min_ps, md.generators
            )
        # Mixed batch: greedy rows take the argmax, the others are sampled as a sub-batch.
        sampled = argmax_rows(logits)
        idx = torch.nonzero(md.temperatures != 0.0).squeeze(1)
        sampled[idx] = random_sample(
            logits.index_select(0, idx),
            md.temperatures.index_select(0, idx),
            md.top_ks.index_select(0, idx),
            md.top_ps.index_select(0, idx),
            md.min_ps.index_select(0, idx),
            [md.generators[i] for i in idx.tolist()],
        )
        return sampled


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


class PenaltyCounts:
    """One sequence's token statistics for the penalties, kept across steps: each step adds
    only the output tokens that are new since the previous one (one `index_add_`, usually of a
    single token), and the prompt's token set is computed once. Rebuilding both from the token
    lists every step cost O(length) a row a step. Ids outside the vocabulary are ignored."""

    def __init__(self) -> None:
        self.output_counts: torch.Tensor | None = None  # [V] float32
        self.prompt_mask: torch.Tensor | None = None  # [V] bool
        self.counted = 0  # output tokens already in output_counts

    def update(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
               vocab_size: int, device: torch.device, need_prompt: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        counts = self.output_counts
        if (counts is None or counts.shape[0] != vocab_size or counts.device != device
                or len(output_token_ids) < self.counted):
            counts = self.output_counts = torch.zeros(vocab_size, dtype=torch.float32,
                                                      device=device)
            self.counted = 0
            self.prompt_mask = None
        if len(output_token_ids) > self.counted:
            new = _in_vocab(output_token_ids[self.counted:], vocab_size, device)
            counts.index_add_(0, new, torch.ones(new.shape[0], dtype=torch.float32,
                                                 device=device))
            self.counted = len(output_token_ids)
        if need_prompt and self.prompt_mask is None:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[_in_vocab(prompt_token_ids, vocab_size, device)] = True
            self.prompt_mask = mask
        return counts, self.prompt_mask


def _in_vocab(ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    return t[(t >= 0) & (t < vocab_size)].to(device)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """vLLM's apply_penalties, on the rows whose penalties are not neutral."""
    active = (
        (md.presence_penalties != 0.0)
        | (md.frequency_penalties != 0.0)
        | (md.repetition_penalties != 1.0)
    )
    idx = torch.nonzero(active).squeeze(1)
    idx_list = idx.tolist()
    if not idx_list:
        return
    vocab_size = logits.shape[1]
    sub = logits.index_select(0, idx)
    rep = md.repetition_penalties.index_select(0, idx)
    need_prompt = bool((rep != 1.0).any())
    states = md.penalty_counts or [None] * len(md.output_token_ids)
    counts, prompts = [], []
    for i in idx_list:
        state = states[i] if states[i] is not None else PenaltyCounts()  # kept or one-off
        c, m = state.update(md.prompt_token_ids[i], md.output_token_ids[i], vocab_size,
                            sub.device, need_prompt)
        counts.append(c)
        prompts.append(m)
    out_counts = torch.stack(counts)
    out_mask = out_counts > 0
    if need_prompt:
        prompt_mask = torch.stack(prompts)
        factor = torch.where(prompt_mask | out_mask, rep.unsqueeze(1), 1.0)
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    sub -= md.frequency_penalties.index_select(0, idx).unsqueeze(1) * out_counts
    sub -= md.presence_penalties.index_select(0, idx).unsqueeze(1) * out_mask
    logits[idx] = sub


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Masks (-inf) tokens outside the top-k and outside the nucleus top-p. `k` 0 = off,
    `p` 1.0 = off, per row. Sorts only when top-p is used."""
    vocab_size = logits.shape[1]
    if p is None:
        if k is None:
            return logits
        return _apply_top_k_only(logits, k)

    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k_eff = torch.where(k > 0, k.clamp(max=vocab_size), vocab_size)
        # The k-th largest value; everything strictly below it goes (ties are kept).
        thresh = logits_sort.gather(1, (vocab_size - k_eff).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < thresh, _NEG_INF)
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    top_p_mask = probs_sum <= (1 - p).unsqueeze(1)
    top_p_mask[:, -1] = False  # always keep the most likely token
    top_p_mask &= (p < 1.0).unsqueeze(1)  # rows with top-p off stay bit-for-bit unchanged
    logits_sort.masked_fill_(top_p_mask, _NEG_INF)
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    off = (k <= 0) | (k >= vocab_size)
    k_eff = k.masked_fill(off, 1)
    max_k = int(k_eff.max())
    thresh = logits.topk(max_k, dim=1).values.gather(1, (k_eff - 1).unsqueeze(1))
    thresh.masked_fill_(off.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < thresh, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < thresh, _NEG_INF)


def random_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p (vLLM's order), then one draw per row
    (`generators[i]` for a seeded row i, the default generator for the others). `logits` is
    modified."""
    gens = generators
    logits.div_(temperatures.unsqueeze(1))
    if bool((min_ps > 0.0).any()):
        logits = apply_min_p(logits, min_ps)
    use_k = bool((top_ks > 0).any())
    use_p = bool((top_ps < 1.0).any())
    if use_k or use_p:
        logits = apply_top_k_top_p(logits, top_ks if use_k else None, top_ps if use_p else None)
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    if any(g is None for g in gens):
        q.exponential_()
    for i, g in enumerate(gens):
        if g is None:
            continue
        if g.device == q.device:
            q[i].exponential_(generator=g)
        else:  # e.g. a CPU generator with GPU logits: draw where the generator lives
            q[i] = torch.empty(q.shape[1], device=g.device).exponential_(generator=g).to(q.device)
    # Exp(1) can return exactly 0 with tiny probability; keep 0/0 (masked tokens) out of reach.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return argmax_rows(probs.div_(q))


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
