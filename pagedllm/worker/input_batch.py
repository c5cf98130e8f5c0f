"""The runner's persistent sampling batch: one row per sampled sequence, kept across steps.

vLLM v1's `InputBatch` idea: a sequence's sampling parameters are written once, into
preallocated per-row tensors, when it joins (a new request, or an n > 1 fork at its first
sample) and stay there until it leaves (finished or aborted: `SchedulerOutput.finished_seq_ids`).
A preemption (recompute or swap) keeps the row: the sequence comes back with the same outputs.
Each step gathers the rows it samples with one `index_select` per parameter, instead of
rebuilding every parameter from Python lists for every row; the penalty statistics of a row
grow by the tokens it sampled (`PenaltyCounts`), never recounted from its token lists.

The engine core describes a row once (`SamplingRowSpec`) and receives the sampled ids and the
logprobs it asked for (`SamplerOutput`); beam-search sequences have no row (beam search reads
their logits itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.layers.sampler import SamplingMetadata
from pagedllm.layers.sampling_draw import make_generator
from pagedllm.layers.sampling_logprobs import SamplerOutput
from pagedllm.layers.sampling_penalties import PenaltyCounts
from pagedllm.sampling_params import _SAMPLING_EPS, SamplingParams


_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


def sample_seed(request_seed: int, index: int) -> int:
    """Seed of sample `index` of a request: the request's own for index 0, then mixed (the
    samples differ, and each is reproducible on its own)."""
    if index == 0:
        return request_seed
    return (request_seed ^ (index * _SEED_MIX)) & _SEED_MASK


_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def position_seed(sample_seed_: int, position: int) -> int:
    """The seed of a seeded sample's draw for its output token `position` (0 = the first).

    Every draw of a seeded sample is seeded by (its seed, the output position it fills), not by
    how many draws came before: so its tokens do not depend on how the engine reached that
    position. Speculative decoding draws once per verified position (several a step, and more
    or fewer as the back-off turns proposals on and off), and still gives the plain engine's
    tokens for the same logits; preemption, batching and the scheduler's choices change nothing."""
    return _splitmix64(_splitmix64(sample_seed_ & _M64) ^ position) & _SEED_MASK


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _to_float32_range(value: float) -> float:
    """Clamp into float32's finite range: a tensor write of 1e308 raises (the list-built tensors
    this replaced rounded it to inf silently, and an infinite temperature turns masked -inf logits
    into NaN), while 3.4e38 acts the same as any huge value."""
    return min(max(value, -_FLOAT32_MAX), _FLOAT32_MAX)


@dataclass
class SamplingRowSpec:
    """What the core tells the runner, once, about a sequence it will sample."""

    seq_id: int
    params: SamplingParams
    index: int  # which of the request's n samples (its seed is params.seed + index)
    prompt_token_ids: Sequence[int]
    # Token ids forbidden while the output is shorter than min_tokens (EOS + stop ids).
    min_tokens_blocked: frozenset[int] = frozenset()
    # n > 1: the seq ids of samples 1 .. n-1, made (as rows here, as sequences in the core)
    # at this sequence's first sample, each drawing its first token from the same logits.
    fork_seq_ids: list[int] = field(default_factory=list)


_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")
_KNOBS = ("random", "penalties", "top_k", "top_p", "min_p")


class InputBatch:
    """Rows of sampling state addressed by seq id; grows by doubling, rows are reused."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu",
                 capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.capacity = 0
        self.row_of: dict[int, int] = {}
        self._free: list[int] = []
        self._floats: dict[str, torch.Tensor] = {}
        self.top_k = torch.empty(0, dtype=torch.int64)
        self.specs: list[SamplingRowSpec | None] = []
        self.generators: list[torch.Generator | None] = []  # a seeded row's, reseeded per draw
        self.seeds: list[int | None] = []  # a seeded row's sample seed (position_seed's base)
        self.output_ids: list[list[int]] = []
        self.penalty_counts: list[PenaltyCounts | None] = []
        # Rows with a knob whose per-row work is a Python loop: visited only when present.
        self._min_tokens_rows: set[int] = set()
        self._bias_rows: set[int] = set()
        # Rows with each tensor knob on, kept at join / leave so that a step's flags are set
        # lookups (mostly on empty sets) instead of five reductions over gathered tensors.
        self._knob_rows: dict[str, set[int]] = {k: set() for k in _KNOBS}
        self._grow(capacity)

    # ---- membership ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.row_of

    def add(self, spec: SamplingRowSpec, output_ids: Sequence[int] = ()) -> int:
        """A sequence joins: its parameters go into a free row (the batch grows when full)."""
        if spec.seq_id in self.row_of:
            raise ValueError(f"sequence {spec.seq_id} already has a sampling row")
        if not self._free:
            self._grow(self.capacity * 2)
        row = self._free.pop()
        p = spec.params
        self.row_of[spec.seq_id] = row
        self.specs[row] = spec
        values = {
            "temperature": 0.0 if p.temperature < _SAMPLING_EPS else p.temperature,
            "top_p": p.top_p, "min_p": p.min_p, "presence": p.presence_penalty,
            "frequency": p.frequency_penalty, "repetition": p.repetition_penalty,
        }
        for name, value in values.items():
            self._floats[name][row] = _to_float32_range(value)
        self.top_k[row] = p.top_k
        self.seeds[row] = sample_seed(p.seed, spec.index) if p.seed is not None else None
        self.generators[row] = make_generator(self.seeds[row]) if p.seed is not None else None
        self.output_ids[row] = list(output_ids)
        self.penalty_counts[row] = (PenaltyCounts() if p.presence_penalty or p.frequency_penalty
                                    or p.repetition_penalty != 1.0 else None)
        if p.min_tokens and spec.min_tokens_blocked:
            self._min_tokens_rows.add(row)
        if p.logit_bias:
            self._bias_rows.add(row)
        on = {"random": values["temperature"] != 0.0,
              "penalties": self.penalty_counts[row] is not None,
              "top_k": p.top_k > 0, "top_p": p.top_p < 1.0, "min_p": p.min_p > 0.0}
        for knob, is_on in on.items():
            if is_on:
                self._knob_rows[knob].add(row)
        return row

    def fork(self, parent_seq_id: int, child_seq_id: int, index: int) -> int:
        """Sample `index` of the parent's request: the parent's parameters, its own seed."""
        parent = self.specs[self.row_of[parent_seq_id]]
        spec = SamplingRowSpec(child_seq_id, parent.params, index, parent.prompt_token_ids,
                               parent.min_tokens_blocked)
        return self.add(spec, self.output_ids[self.row_of[parent_seq_id]])

    def remove(self, seq_id: int) -> None:
        """A sequence left for good (finished or aborted); unknown ids are ignored (beams)."""
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.specs[row] = None
        self.generators[row] = None
        self.seeds[row] = None
        self.output_ids[row] = []
        self.penalty_counts[row] = None
        self._min_tokens_rows.discard(row)
        self._bias_rows.discard(row)
        for rows in self._knob_rows.values():
            rows.discard(row)
        self._free.append(row)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        if capacity <= old:
            return
        for name in _FLOAT_PARAMS:
            t = torch.zeros(capacity, dtype=torch.float32)
            if old:
                t[:old] = self._floats[name]
            self._floats[name] = t
        top_k = torch.zeros(capacity, dtype=torch.int64)
        top_k[:old] = self.top_k
        self.top_k = top_k
        extra = capacity - old
        self.specs += [None] * extra
        self.generators += [None] * extra
        self.seeds += [None] * extra
        self.output_ids += [[] for _ in range(extra)]
        self.penalty_counts += [None] * extra
        self._free.extend(range(capacity - 1, old - 1, -1))  # lowest rows first
        self.capacity = capacity

    # ---- a step -------------------------------------------------------------------------

    def start_rows(self, seq_id: int) -> list[int]:
        """The rows one sampling item draws this step: its own, plus, at an n > 1 sequence's
        first sample, the rows of its forks (made now)."""
        row = self.row_of[seq_id]
        spec = self.specs[row]
        if not spec.fork_seq_ids:
            return [row]
        forks = [self.fork(seq_id, child, i + 1) for i, child in enumerate(spec.fork_seq_ids)]
        spec.fork_seq_ids = []
        return [row] + forks

    def metadata(self, rows: list[int], device: torch.device,
                 token_bitmask: torch.Tensor | None = None,
                 bitmask_rows: list[int] | None = None,
                 extra_outputs: list[list[int]] | None = None) -> SamplingMetadata:
        """The sampler's inputs for `rows` (in the order of the logits rows; a row may repeat).

        `extra_outputs[i]`: tokens that logits row i sees after its sequence's outputs (the
        draft tokens before a verified position, speculative decoding): min_tokens and the
        penalties then count them, from the lists (the sequence's kept counts stay its own)."""
        n = len(rows)
        lo = rows[0] if rows else 0
        if rows == list(range(lo, lo + n)):  # the usual case: views, no copy
            def gather(t: torch.Tensor) -> torch.Tensor:
                return t[lo: lo + n].to(device, non_blocking=True)
        else:
            idx = torch.tensor(rows, dtype=torch.int64)

            def gather(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, idx).to(device, non_blocking=True)

        def count(knob: str) -> int:
            on = self._knob_rows[knob]
            return 0 if not on else sum(1 for r in rows if r in on)

        f = {name: gather(t) for name, t in self._floats.items()}
        top_ks = gather(self.top_k)
        temps = f["temperature"]
        num_random = count("random")
        min_tokens_mask: list[set[int] | None] = [None] * n
        logit_bias: list[dict[int, float] | None] = [None] * n
        outputs = [self.output_ids[r] for r in rows]
        if extra_outputs is not None:
            outputs = [o + e if e else o for o, e in zip(outputs, extra_outputs)]
        if self._min_tokens_rows or self._bias_rows:
            for i, r in enumerate(rows):
                spec = self.specs[r]
                if r in self._min_tokens_rows and len(outputs[i]) < spec.params.min_tokens:
                    min_tokens_mask[i] = set(spec.min_tokens_blocked)
                if r in self._bias_rows:
                    logit_bias[i] = spec.params.logit_bias
        specs = [self.specs[r] for r in rows]
        no_penalties = count("penalties") == 0
        return SamplingMetadata(
            temperatures=temps, top_ps=f["top_p"], top_ks=top_ks, min_ps=f["min_p"],
            presence_penalties=f["presence"], frequency_penalties=f["frequency"],
            repetition_penalties=f["repetition"],
            prompt_token_ids=[s.prompt_token_ids for s in specs],
            output_token_ids=outputs,
            generators=self._position_generators(rows, outputs),
            penalty_counts=None if no_penalties else [
                None if extra_outputs is not None and extra_outputs[i] else self.penalty_counts[r]
                for i, r in enumerate(rows)],
            num_logprobs=[s.params.logprobs for s in specs],
            logit_bias=logit_bias,
            min_tokens_mask=min_tokens_mask,
            all_greedy=num_random == 0,
            all_random=num_random == n,
            no_penalties=no_penalties,
            no_top_k=count("top_k") == 0,
            no_top_p=count("top_p") == 0,
            no_min_p=count("min_p") == 0,
            token_bitmask=token_bitmask,
            bitmask_rows=bitmask_rows,
        )

    def _position_generators(self, rows: list[int], outputs: list[list[int]]) -> list[torch.Generator | None]:
        """Per logits row: its seeded row's generator, seeded for the output position it draws
        (`position_seed`); a row drawn at several positions (verified drafts) gets a generator
        per position. None for unseeded rows (the default generator)."""
        gens: list[torch.Generator | None] = [None] * len(rows)
        used: set[int] = set()
        for i, r in enumerate(rows):
            g = self.generators[r]
            if g is None:
                continue
            if r in used:
                g = torch.Generator(device=g.device)
            used.add(r)
            g.manual_seed(position_seed(self.seeds[r], len(outputs[i])))
            gens[i] = g
        return gens

    def record(self, rows: list[int], token_ids: list[int]) -> None:
        """The tokens just sampled join their rows' outputs (min_tokens and the penalties read
        them; `PenaltyCounts` adds only these at the next step that needs it)."""
        outs = self.output_ids
        for r, t in zip(rows, token_ids):
            outs[r].append(t)


def sample_batch(sampler, batch: InputBatch, logits: torch.Tensor, rows: list[int],
                 logits_rows: list[int], mask_keys: list[int],
                 masks: dict[int, torch.Tensor] | None,
                 extra_outputs: list[list[int]] | None = None) -> SamplerOutput:
    """Draw one token for each of `rows` from `logits[logits_rows[i]]`. `masks`: seq id ->
    packed allowed-token row; row i takes the mask of `mask_keys[i]` (a fork its parent's: at
    the first sample their grammars are in the same state). With `extra_outputs` (draft
    tokens each row sees, speculative decoding) the rows may repeat and nothing is recorded:
    the caller records the tokens it keeps."""
    if logits_rows != list(range(logits.shape[0])):
        logits = logits.index_select(0, torch.tensor(logits_rows, device=logits.device))
    token_bitmask = bitmask_rows = None
    if masks:
        keyed = [(i, masks[k]) for i, k in enumerate(mask_keys) if k in masks]
        if keyed:
            bitmask_rows = [i for i, _ in keyed]
            token_bitmask = torch.stack([m for _, m in keyed])
    md = batch.metadata(rows, logits.device, token_bitmask, bitmask_rows, extra_outputs)
    out = sampler(logits, md)
    if extra_outputs is None:
        batch.record(rows, out.sampled_token_ids)
    return out
