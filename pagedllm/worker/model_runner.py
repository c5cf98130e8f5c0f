"""Turns a step plan into tensors, runs the model over the paged KV cache, samples.

The contract is the frozen `StepPlan` (core/step_plan.py): per scheduled sequence
(`SequenceStep`) its id, the tokens run at positions `start_pos ..`, the change to the runner's
copy of its block table (`blocks_from` / `new_block_ids`, which then covers every position up to
`start_pos + len(token_ids) - 1`; worker/block_table.py), whether it samples and whether every
row's logits come back; for the step the tables to drop first and the swap-out, swap-in and
copy-on-write block pairs to apply first, in that order.

Sampling happens here, on the persistent batch (worker/input_batch.py, vLLM v1's InputBatch):
the plan's `new_sampling_rows` (one `SamplingRowSpec` per sequence, sent once) and
`finished_seq_ids` keep it, its `token_masks` (a future of seq id -> packed allowed-token row,
(seq id, j) -> the row after a speculating sequence's first j drafts, filled by the core while
the forward runs) constrains it, and the core gets back the sampled ids and logprobs
(`ModelRunnerOutput.sampled`). Sequences without a row (beam search) get their logits row.

Inside a step the runner orders the batch decodes first (sequences with exactly one query token),
then the rest (prefills), as `AttentionMetadata` requires; outputs come back in scheduled order.

With `compile_batch_sizes` (CPU), decode-only steps run in compiled graphs
(worker/decode_graphs.py) once the graph of their padded batch size is ready; with
`cuda_graph_sizes` (GPU) they replay captured CUDA graphs (worker/cuda_graphs.py, captured by
`capture_cuda_graphs` at start-up); every other step runs the eager model. The cache then has one
extra *scratch* block past `num_blocks` that the block pool never hands out: padded rows write there.

On a GPU a step's inputs are built on the host, packed into one pinned buffer and copied with
one non-blocking copy (`_upload`); the step's one synchronisation is reading the sampled tokens.

Under tensor parallelism every rank runs its own runner on the same steps (executor/): the
model is the rank's shard, the cache holds only its KV heads (`model.num_kv_heads`), and only
rank 0 gets logits back. Image rows: worker/mm_embeddings.py (M-RoPE: worker/mrope_positions.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.core.kv_cache_groups import KVCacheGroups
from pagedllm.core.step_plan import SequenceStep, StepPlan
from pagedllm.layers.attention import Attention, AttentionMetadata
from pagedllm.layers.sampler import Sampler
from pagedllm.layers.sampling_logprobs import SamplerOutput
from pagedllm.layers.rotary import head_dim_of
from pagedllm.worker.block_table import BlockTable
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.cpu_decode_step import CpuDecodeStep
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.decode_graphs import DecodeGraphs
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.mm_embeddings import MultiModalEmbeddings
from pagedllm.worker.mrope_positions import mrope_positions
from pagedllm.worker.step_sampling import sample_step


@dataclass
class ModelRunnerOutput:
    # One float32 row per scheduled sequence with sample=True, in scheduled order.
    sample_logits: torch.Tensor
    # seq_id -> float32 [len(token_ids), vocab] for scheduled sequences with all_logits=True.
    all_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # The tokens drawn for the sampled sequences that have a sampling row, in scheduled order,
    # each followed by its n > 1 forks at its first sample (InputBatch.start_rows).
    sampled: SamplerOutput | None = None
    # Speculative decoding: seq id -> how many of its draft tokens the target accepted; such a
    # sequence has that many rows in `sampled` plus one (and 1 + its drafts in sample_logits).
    num_accepted: dict[int, int] = field(default_factory=dict)
    # A draft model's proposals this step: seq id -> the draft tokens it verified.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Pooling models: seq id -> this step's final hidden rows of each sequence with `pool`.
    pooled_hidden: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ModelInput:
    """The tensors of one step (batch in decodes-first order) and where the logits rows are."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_rows: list[int]  # hidden rows to project to logits
    sample_indices: list[int]  # per sampled sequence (scheduled order): its row in the logits
    all_logits_slices: list[tuple[int, int, int]]  # (seq_id, first logits row, number of rows)
    # Per scheduled sequence (scheduled order): the row of its first token in `input_ids`.
    first_rows: list[int] = field(default_factory=list)
    # A decode-only step whose every sequence samples one row: it may run a compiled graph.
    decode_only: bool = False
    # Multi-LoRA: each token's adapter slot (int32, -1: the base model); None: LoRA off.
    lora_indices: torch.Tensor | None = None
    # Image inputs: the step's input embeddings when a chunk holds image rows; None: from the ids.
    inputs_embeds: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_model_len: int | None = None,
        compile_batch_sizes: list[int] | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        cuda_graph_sizes: list[int] | None = None,
        kv_cache_groups: KVCacheGroups | None = None,
        cpu_decode_step: bool = True,
    ) -> None:
        """`kv_cache_dtype`: the cache's storage dtype (layers/kv_cache_dtype.py); None: `dtype`.
        `cuda_graph_sizes`: the decode buckets to capture (GPU, a capture-safe attention backend).
        `kv_cache_groups`: a hybrid KV cache's groups (docs/hybrid_kv_cache.md): a block table
        per group, one cache tensor per slot shared by the groups' layers. `cpu_decode_step`:
        decode-only steps on CPU run as one C call where the model allows it
        (worker/cpu_decode_step.py; False: eager, as `enforce_eager` asks)."""
        hybrid = kv_cache_groups is not None and kv_cache_groups.is_hybrid
        if hybrid and (compile_batch_sizes or cuda_graph_sizes):
            raise ValueError("compile_batch_sizes and cuda_graph_sizes are not supported with a hybrid KV "
                             "cache yet (their graphs read one block table); pass "
                             "disable_hybrid_kv_cache_manager=True to use them")
        self.kv_cache_groups = kv_cache_groups if hybrid else None
        layer_slots = None
        if self.kv_cache_groups is not None:
            layer_slots = self._assign_groups(model, hf_config, self.kv_cache_groups)
        self.model = model
        self.hf_config = hf_config
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.vocab_size = hf_config.vocab_size
        self.cache_engine = CacheEngine(
            num_layers=hf_config.num_hidden_layers,
            # this rank's KV heads (all of them without tensor parallelism)
            num_kv_heads=getattr(model, "num_kv_heads", None)
            or getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=head_dim_of(hf_config),
            num_blocks=num_blocks + (1 if compile_batch_sizes or cuda_graph_sizes else 0),  # + the scratch block
            block_size=block_size,
            dtype=kv_cache_dtype or dtype,
            device=self.device,
            layer_slots=layer_slots,
        )
        max_len = max_model_len or int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
        num_groups = 1 if self.kv_cache_groups is None else len(self.kv_cache_groups.groups)
        self.block_tables = [BlockTable(-(-max_len // block_size) + 1) for _ in range(num_groups)]
        self.block_table = self.block_tables[0]
        self.sampler = Sampler()
        self.input_batch = InputBatch(self.vocab_size, self.device)
        self.decode_graphs: DecodeGraphs | None = None
        if compile_batch_sizes:
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size,
                max_model_len or int(hf_config.max_position_embeddings),
                scratch_block=num_blocks,
                batch_sizes=compile_batch_sizes,
                device=self.device,
            )
        # Speculative decoding's draft model (worker/draft_runner.py), attached by the worker.
        self.drafter: Any = None
        # Multi-LoRA's adapter slots (lora/worker_manager.py), attached by the worker.
        self.lora: Any = None
        self.cpu_decode_step: CpuDecodeStep | None = None
        if cpu_decode_step and self.device.type == "cpu" and not compile_batch_sizes:
            self.cpu_decode_step = CpuDecodeStep.create(model, self.kv_caches, block_size)
        self.mm_embeddings = MultiModalEmbeddings.of(model, self.device)  # image inputs; None: text only
        self.mrope = bool(getattr(model, "uses_mrope", False))  # M-RoPE: worker/mrope_positions.py
        self.cuda_graphs: CudaGraphRunner | None = None
        if cuda_graph_sizes:
            self.cuda_graphs = CudaGraphRunner(model, self.kv_caches, block_size, max_len, scratch_block=num_blocks,
                                               batch_sizes=cuda_graph_sizes, device=self.device)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.cache_engine.kv_caches

    @staticmethod
    def _assign_groups(model: nn.Module, hf_config: Any, groups: KVCacheGroups) -> list[int]:
        """Tell each attention layer its group; returns each layer's slot tensor. The layers'
        own windows must be the groups' (they are what the kernels mask by)."""
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if len(layers) != groups.num_layers:
            raise ValueError(f"the KV cache groups name {groups.num_layers} layers, the model has "
                             f"{len(layers)} attention layers")
        slots = [0] * len(layers)
        for layer, (g, slot) in groups.layer_slot().items():
            window = groups.groups[g].sliding_window
            if layers[layer].sliding_window != window:
                raise ValueError(f"layer {layer}: its sliding window is {layers[layer].sliding_window}, "
                                 f"its KV cache group's {window}")
            layers[layer].kv_cache_group = g
            slots[layer] = slot
        return slots

    def prepare_input(self, scheduled: list[SequenceStep]) -> ModelInput:
        """Input ids, positions, slot mapping and attention metadata for a non-empty step."""
        B = self.block_size
        q_lens = [len(s.token_ids) for s in scheduled]
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        prefills = [i for i, n in enumerate(q_lens) if n != 1]
        slot_of = None
        if self.lora is not None:
            # Multi-LoRA: each part's sequences grouped by adapter slot, so that the LoRA kernels
            # see runs of one slot and read each adapter's A and B once per run, not per token.
            slot_of = {i: self.lora.slot_of(s.lora_int_id) for i, s in enumerate(scheduled)}
            decodes.sort(key=slot_of.__getitem__)
            prefills.sort(key=slot_of.__getitem__)
        order = decodes + prefills
        num_decodes = len(decodes)

        token_ids: list[int] = []
        lens, starts, ctx_lens, n_blocks_of, rows = [], [], [], [], []
        table = self.block_table
        group_rows: list[list[int]] = [[] for _ in self.block_tables[1:]]
        for i in order:
            s = scheduled[i]
            token_ids.extend(s.token_ids)
            ctx = s.start_pos + q_lens[i]
            n_blocks = -(-ctx // B)
            if q_lens[i] == 0:
                raise ValueError(f"Sequence {s.seq_id} is scheduled with no tokens")
            row = table.apply(s.seq_id, s.blocks_from, s.new_block_ids)  # usually 0-1 ids
            if group_rows:
                deltas = s.group_deltas
                if len(deltas) != len(group_rows):
                    raise ValueError(f"Sequence {s.seq_id}: {len(deltas)} group table deltas for "
                                     f"{len(group_rows) + 1} KV cache groups")
                for rows_g, t, (start, ids) in zip(group_rows, self.block_tables[1:], deltas):
                    rows_g.append(t.apply(s.seq_id, start, ids))
            if table.num_blocks(row) < n_blocks:
                raise ValueError(
                    f"Sequence {s.seq_id}: block table has {table.num_blocks(row)} blocks, "
                    f"{n_blocks} needed for {ctx} tokens"
                )
            lens.append(q_lens[i])
            starts.append(s.start_pos)
            ctx_lens.append(ctx)
            n_blocks_of.append(n_blocks)
            rows.append(row)
        max_blocks = max(n_blocks_of)

        # Vectorised positions and slot mapping: token t of (reordered) sequence j sits at
        # position start_j + (t - query_start_j).
        lens_t = torch.tensor(lens, dtype=torch.long)
        query_starts_t = torch.cumsum(lens_t, 0) - lens_t
        seq_of_token = torch.repeat_interleave(torch.arange(len(order)), lens_t)
        offsets = torch.tensor(starts, dtype=torch.long) - query_starts_t
        num_tokens = len(token_ids)
        positions = torch.arange(num_tokens, dtype=torch.long) + offsets[seq_of_token]
        # The step's tables in one gather from the persistent rows. Entries past a sequence's
        # own blocks hold 0 or other valid ids: masked, never attended.
        block_tables = table.tensor[:, :max_blocks].index_select(0, torch.tensor(rows, dtype=torch.long))
        slot_mapping = block_tables[seq_of_token, positions // B] * B + positions % B
        group_tables = [t.tensor[:, :max_blocks].index_select(0, torch.tensor(r, dtype=torch.long))
                        for t, r in zip(self.block_tables[1:], group_rows)]

        query_starts = query_starts_t.tolist()
        num_prefills = len(order) - num_decodes
        host: dict[str, torch.Tensor] = {
            "input_ids": torch.tensor(token_ids, dtype=torch.long),
            "positions": positions,
            "slot_mapping": slot_mapping,
        }
        if self.mrope:  # the rotary's positions; the slots above keep the KV positions
            host["positions"] = mrope_positions(positions, [scheduled[i] for i in order], query_starts)
        max_decode_blocks = -(-max(ctx_lens[:num_decodes], default=0) // B)
        max_prefill_blocks = max(n_blocks_of[num_decodes:], default=0)
        for g, tables in enumerate([block_tables, *group_tables]):
            key = "" if g == 0 else f"/{g}"
            if g:
                host["slot_mapping" + key] = tables[seq_of_token, positions // B] * B + positions % B
            if num_decodes:
                host["decode_block_tables" + key] = tables[:num_decodes, :max_decode_blocks]
            if num_prefills:
                host["prefill_tables" + key] = tables[num_decodes:, :max_prefill_blocks]
        if num_decodes:
            host["decode_context_lens"] = torch.tensor(ctx_lens[:num_decodes], dtype=torch.long)
        if num_prefills:
            first = query_starts[num_decodes]
            host["prefill_query_start_loc"] = torch.tensor(
                [q - first for q in query_starts[num_decodes:]] + [num_tokens - first], dtype=torch.long)
            host["prefill_context_lens"] = torch.tensor(ctx_lens[num_decodes:], dtype=torch.long)
        dev_t = self._upload(host)
        prefill_padded = dev_t.get("prefill_tables")
        attn_metadata = AttentionMetadata(
            slot_mapping=dev_t["slot_mapping"],
            block_size=B,
            num_decode_tokens=num_decodes,
            decode_block_tables=dev_t.get("decode_block_tables"),
            decode_context_lens=dev_t.get("decode_context_lens"),
            prefill_query_starts=query_starts[num_decodes:],
            prefill_query_lens=lens[num_decodes:],
            prefill_context_lens=ctx_lens[num_decodes:],
            # views of the one padded table: no copy per sequence
            prefill_block_tables=[prefill_padded[j, : n_blocks_of[num_decodes + j]] for j in range(num_prefills)],
            prefill_block_tables_padded=prefill_padded,
            prefill_query_start_loc=dev_t.get("prefill_query_start_loc"),
            prefill_context_lens_tensor=dev_t.get("prefill_context_lens"),
            max_prefill_query_len=max(lens[num_decodes:], default=0),
            prefill_seq_lens=[max(scheduled[i].seq_len, ctx_lens[num_decodes + j])
                              for j, i in enumerate(order[num_decodes:])],
        )
        for g in range(1, len(self.block_tables)):  # the same batch through each group's tables
            padded = dev_t.get(f"prefill_tables/{g}")
            attn_metadata.group_metadata.append(dataclasses.replace(
                attn_metadata, slot_mapping=dev_t[f"slot_mapping/{g}"],
                decode_block_tables=dev_t.get(f"decode_block_tables/{g}"),
                prefill_block_tables=[padded[j, : n_blocks_of[num_decodes + j]] for j in range(num_prefills)],
                prefill_block_tables_padded=padded, group_metadata=[]))

        # Logits rows: every row of an all_logits sequence (its last row doubles as its sample
        # row), the last row of the other sampled sequences.
        row_of = {i: query_starts[j] for j, i in enumerate(order)}  # scheduled idx -> first row
        logits_rows: list[int] = []
        sample_indices: list[int] = []
        all_logits_slices: list[tuple[int, int, int]] = []
        for i, s in enumerate(scheduled):
            first, n = row_of[i], q_lens[i]
            if s.all_logits:
                all_logits_slices.append((s.seq_id, len(logits_rows), n))
                logits_rows.extend(range(first, first + n))
                if s.sample:
                    sample_indices.append(len(logits_rows) - 1)
            elif s.sample:  # the last row, and with draft tokens the rows verifying them
                nd = len(s.draft_token_ids)
                sample_indices.extend(range(len(logits_rows), len(logits_rows) + nd + 1))
                logits_rows.extend(range(first + n - 1 - nd, first + n))
        lora_indices = None
        if slot_of is not None:
            slots = torch.tensor([slot_of[i] for i in order], dtype=torch.int32)
            lora_indices = torch.repeat_interleave(slots, lens_t).to(self.device)
        return ModelInput(
            lora_indices=lora_indices,
            input_ids=dev_t["input_ids"],
            positions=dev_t["positions"],
            attn_metadata=attn_metadata,
            logits_rows=logits_rows,
            sample_indices=sample_indices,
            all_logits_slices=all_logits_slices,
            first_rows=[row_of[i] for i in range(len(scheduled))],
            decode_only=num_decodes == len(order) and not all_logits_slices and len(sample_indices) == len(order)
            and dev_t["positions"].dim() == 1,
        )

    def _upload(self, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's int64 host tensors on the device. CPU: as they are (contiguous). GPU: packed
        into one pinned buffer, one non-blocking copy, then views of it."""
        if self.device.type == "cpu":
            return {k: v.contiguous() for k, v in host.items()}
        flat = torch.cat([v.reshape(-1) for v in host.values()]).pin_memory()
        on_device = flat.to(self.device, non_blocking=True)
        out, at = {}, 0
        for name, v in host.items():
            out[name] = on_device[at : at + v.numel()].view(v.shape)
            at += v.numel()
        return out

    def capture_cuda_graphs(self) -> None:
        """Capture the decode buckets (start-up, after the cache exists: the graphs read it)."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.capture_all()

    @torch.no_grad()
    def execute_model(self, plan: StepPlan) -> ModelRunnerOutput | None:
        for seq_id in plan.released_seq_ids:
            for table in self.block_tables:
                table.release(seq_id)
        batch = self.input_batch
        for spec in plan.new_sampling_rows:
            batch.add(spec)
        for seq_id in plan.finished_seq_ids:
            batch.remove(seq_id)
        # Swaps before copies: a swap-out frees blocks a copy may fill; a copy may read a
        # block that was just swapped in. A draft model's KV lives in the same blocks.
        caches = [self.cache_engine] + ([self.drafter.cache_engine] if self.drafter is not None else [])
        for cache in caches:
            cache.swap_out(plan.blocks_to_swap_out)
            cache.swap_in(plan.blocks_to_swap_in)
            if plan.block_copies:
                cache.copy_blocks(plan.block_copies)
        if self.mm_embeddings is not None:  # the encoder cache: frees, then this step's images
            self.mm_embeddings.apply(plan)
        scheduled = plan.sequences
        if not scheduled:
            return ModelRunnerOutput(torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device))
        if scheduled[0].pool:
            return self.execute_pooling(plan)
        if self.lora is not None:  # the step's adapters into slots (loaded on demand)
            self.lora.begin_step(plan.lora_requests)
        inp = self.prepare_input(scheduled)  # applies the table changes the draft reads too
        if self.mm_embeddings is not None:
            self.mm_embeddings.attach(inp, scheduled)
        drafts = self.drafter.propose(scheduled) if self.drafter is not None else {}
        if drafts:
            self._fill_drafts(inp, scheduled, drafts)
        logits = self.run_model(inp)
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 has the logits
            return None
        if logits.shape[0] == 0:
            return ModelRunnerOutput(logits)
        if inp.sample_indices == list(range(logits.shape[0])):
            sample_logits = logits
        else:
            sample_logits = logits[torch.tensor(inp.sample_indices, dtype=torch.long, device=self.device)]
        all_logits = {seq_id: logits[at : at + n] for seq_id, at, n in inp.all_logits_slices}
        out = ModelRunnerOutput(sample_logits=sample_logits, all_logits=all_logits, draft_token_ids=drafts)
        out.sampled = sample_step(self.sampler, self.input_batch, plan, sample_logits, out.num_accepted, drafts)
        return out

    def _fill_drafts(self, inp: ModelInput, scheduled: list[SequenceStep], drafts: dict[int, list[int]]) -> None:
        """Put the draft model's tokens where the step's placeholder drafts are."""
        rows: list[int] = []
        values: list[int] = []
        for i, s in enumerate(scheduled):
            d = drafts.get(s.seq_id)
            if d:
                at = inp.first_rows[i] + len(s.token_ids) - len(d)
                rows.extend(range(at, at + len(d)))
                values.extend(d)
        inp.input_ids[torch.tensor(rows, dtype=torch.long, device=self.device)] = torch.tensor(
            values, dtype=inp.input_ids.dtype, device=self.device)

    def execute_pooling(self, plan: StepPlan) -> ModelRunnerOutput:
        """A pooling model's step (docs/pooling.md): every sequence pools; its final hidden
        rows of this step come back (`pooled_hidden`), no logits, no sampling rows."""
        scheduled = plan.sequences
        if not all(s.pool for s in scheduled):
            raise ValueError("a step mixes pooling and sampled sequences: a core serves one kind of model")
        inp = self.prepare_input(scheduled)
        with torch.inference_mode():
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)
        empty = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return ModelRunnerOutput(empty, pooled_hidden={s.seq_id: hidden[first:first + len(s.token_ids)]
                                                       for first, s in zip(inp.first_rows, scheduled)})

    def run_model(self, inp: ModelInput) -> torch.Tensor | None:
        """float32 logits of the rows `inp.logits_rows`: from a compiled decode graph where one
        is ready for this step, else from the eager model (None on tensor-parallel ranks > 0)."""
        graphs = self.cuda_graphs or self.decode_graphs
        if inp.decode_only and graphs is not None:
            md = inp.attn_metadata
            logits = graphs.run(
                inp.input_ids, inp.positions, md.slot_mapping, md.decode_block_tables, md.decode_context_lens
            )
            if logits is not None:
                return logits  # decode-only: row i is sequence i, in scheduled order
        hidden = None
        if inp.decode_only and self.cpu_decode_step is not None and self.lora is None:
            md = inp.attn_metadata
            with torch.inference_mode():
                hidden = self.cpu_decode_step.run(inp.input_ids, inp.positions, md)
        if hidden is None:
            if self.lora is not None:
                self.lora.context.set(inp.lora_indices, self.lora.config.max_loras)
            with torch.inference_mode():
                images = {} if inp.inputs_embeds is None else {"inputs_embeds": inp.inputs_embeds}
                hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata, **images)
        if not inp.logits_rows:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if inp.logits_rows == list(range(hidden.shape[0])):
            selected = hidden
        else:
            selected = hidden[torch.tensor(inp.logits_rows, dtype=torch.long, device=self.device)]
        # Outside inference mode, so that the logits are ordinary tensors that the sampler may
        # modify in place.
        return self.model.compute_logits(selected)

    def wait_for_compilation(self, *batch_sizes: int, timeout: float | None = None) -> bool:
        """Block until the decode graphs for these batch sizes (default: every bucket) are
        compiled; True if they all are. False without compilation (`enforce_eager`)."""
        if self.decode_graphs is None:
            return False
        buckets = [b for b in (self.decode_graphs.bucket_for(n) for n in batch_sizes) if b is not None]
        return self.decode_graphs.wait(buckets or None, timeout=timeout)

    @torch.no_grad()
    def profile_run(self, num_tokens: int, num_seqs: int = 1) -> int:
        """A dummy step of `num_tokens` prefill tokens over `num_seqs` sequences, each sampled (a
        logits row each): the activation peak of the largest step, for sizing the KV cache on a
        GPU. Built by `prepare_input` like any step, every block table pointing at block 0: it
        writes garbage into the cache, so use it on a throwaway runner. Returns the logits rows."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        base, extra = divmod(num_tokens, num_seqs)
        steps = []
        for i in range(num_seqs):
            n = base + (1 if i < extra else 0)
            # a prefill of n dummy tokens, its table all block 0
            steps.append(SequenceStep(i, [0] * n, 0, 0, [0] * -(-n // self.block_size), True))
        inp = self.prepare_input(steps)
        logits = self.run_model(inp)
        for s in steps:
            for table in self.block_tables:
                table.release(s.seq_id)
        return 0 if logits is None else int(logits.shape[0])  # logits rows (rank 0)
