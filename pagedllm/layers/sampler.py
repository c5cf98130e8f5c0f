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

Here: the per-row inputs (`SamplingRow`, `SamplingMetadata`) and the `Sampler` that applies the
steps in order. The steps are in layers/sampling_masks.py (0-2), sampling_penalties.py (3),
sampling_draw.py (4-5), the logprobs in sampling_logprobs.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.layers.sampling_draw import argmax_rows, random_sample
from pagedllm.layers.sampling_logprobs import SamplerOutput, _gather_logprobs
from pagedllm.layers.sampling_masks import apply_logit_bias, apply_min_tokens_mask, apply_token_bitmask
from pagedllm.layers.sampling_penalties import PenaltyCounts, apply_penalties
from pagedllm.sampling_params import _SAMPLING_EPS, SamplingParams


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
