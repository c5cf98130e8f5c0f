"""The model runner of encoder-only pooling models (BERT, RoBERTa, XLM-RoBERTa and their
`*ForSequenceClassification` cross-encoders), in the engine core's executor seat.

An encoder has no KV cache: attention is bidirectional over the whole prompt, so nothing a step
computes is reused by a later one. The design (vLLM v1 runs encoder-only models through the same
scheduler, with no KV cache spec): the one `EngineCore` schedules encoder requests like any
other, with chunked prefill and prefix caching off, so every request is scheduled once, whole,
within the step's token budget (`max_num_batched_tokens`) and `max_num_seqs`; its KV blocks
are bookkeeping only (engine/core_pooling.encoder_pool_blocks: enough for one full step, no
tensors behind them) and return to the pool when it finishes after that step. This runner
reads the step plan's `SequenceStep`s (`pool`, `token_ids`, `token_type_ids`), runs
transformers' own modules (a well-kept implementation: parity by construction) over the step's
prompts (cut into batches of near lengths, `length_groups`, each padded to its longest), and returns each sequence's final hidden rows (a classifier: its
logits row) for the core to pool."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.core.step_plan import SequenceStep, StepPlan
from pagedllm.model.registry import ENCODER_CLASSIFY_ARCHS
from pagedllm.worker.model_runner import ModelRunnerOutput

# A batch pads its prompts to the longest: at most this share of its real tokens is padding.
PADDING_ALLOWED = 0.25


class EncoderRunner:
    """Executor and runner at once (one device, no workers): `execute_model(plan)` ->
    `ModelRunnerOutput.pooled_hidden`."""

    decode_graphs = None  # nothing is compiled: no decode steps
    lora = None  # LoRA applies to generation models
    world_size = 1
    kv_share = 1

    def __init__(self, model_path: str, hf_config: Any, arch: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification

        self.is_classifier = arch in ENCODER_CLASSIFY_ARCHS
        cls = AutoModelForSequenceClassification if self.is_classifier else AutoModel
        self.model = cls.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        self.device = device
        self.pad_id = int(getattr(hf_config, "pad_token_id", None) or 0)
        self.use_token_types = getattr(self.model.config, "type_vocab_size", 0) > 1

    @property
    def model_runner(self) -> "EncoderRunner":
        return self

    def initialize_cache(self, num_blocks: int, num_host_blocks: int, max_model_len: int,
                         compile_batch_sizes: list[int] | None = None) -> None:
        """No KV cache to allocate: the core's blocks for an encoder are bookkeeping only."""

    def shutdown(self) -> None:
        """Nothing runs beside this process."""

    @torch.inference_mode()
    def execute_model(self, plan: StepPlan) -> ModelRunnerOutput:
        steps = plan.sequences
        for s in steps:
            if not s.pool or s.start_pos != 0 or not s.sample:
                raise ValueError(f"Sequence {s.seq_id}: an encoder runs whole prompts that pool "
                                 f"(pool={s.pool}, start_pos={s.start_pos}, sample={s.sample})")
        pooled: dict[int, torch.Tensor] = {}
        for group in length_groups(steps):
            pooled.update(self._forward(group))
        return ModelRunnerOutput(torch.empty(0, dtype=torch.float32), pooled_hidden=pooled)

    def _forward(self, steps: list[SequenceStep]) -> dict[int, torch.Tensor]:
        """One padded batch: each sequence's final hidden rows (a classifier: its logits row)."""
        longest = max(len(s.token_ids) for s in steps)
        ids = torch.full((len(steps), longest), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(steps), longest), dtype=torch.long)
        mask = torch.zeros((len(steps), longest), dtype=torch.long)
        for i, s in enumerate(steps):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids)
            if s.token_type_ids:
                types[i, :n] = torch.tensor(s.token_type_ids)
            mask[i, :n] = 1
        kwargs = dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        if self.use_token_types:
            kwargs["token_type_ids"] = types.to(self.device)
        out = self.model(**kwargs)
        if self.is_classifier:
            logits = out.logits.float()
            return {s.seq_id: logits[i:i + 1] for i, s in enumerate(steps)}
        hidden = out.last_hidden_state
        return {s.seq_id: hidden[i, :len(s.token_ids)] for i, s in enumerate(steps)}


def length_groups(steps: list[SequenceStep], max_padding: float = PADDING_ALLOWED) -> list[list[SequenceStep]]:
    """The step's prompts by length, cut into batches that pad at most `max_padding` of their
    real tokens: a padded row costs a whole forward row, and the scheduler's step mixes lengths
    (it admits in arrival order)."""
    groups: list[list[SequenceStep]] = []
    total = 0
    for s in sorted(steps, key=lambda s: len(s.token_ids)):
        n = len(s.token_ids)
        if groups and n * (len(groups[-1]) + 1) <= (1 + max_padding) * (total + n):
            groups[-1].append(s)
            total += n
        else:
            groups.append([s])
            total = n
    return groups
