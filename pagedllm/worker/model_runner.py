"""Turns a scheduler step into tensors, runs the model over the paged KV cache, returns logits.

Contract with the scheduler (duck-typed): `scheduler_output.scheduled` is a list of scheduled
sequences with `.seq.seq_id`, `.token_ids` (run at positions `start_pos ..`), `.start_pos`,
`.block_table` (covers every position up to `start_pos + len(token_ids) - 1`), `.sample` and
`.all_logits`; `scheduler_output.block_copies` lists `(src, dst)` block copies to do first, after
the optional `blocks_to_swap_out` (device, host) and `blocks_to_swap_in` (host, device) pairs.

Inside a step the runner orders the batch decodes first (sequences with exactly one query token),
then the rest (prefills), as `AttentionMetadata` requires; outputs come back in scheduled order.

With `compile_batch_sizes`, decode-only steps run in compiled graphs (worker/decode_graphs.py)
once the graph of their padded batch size is ready; every other step, and every step before
that, runs the eager model. The cache then has one extra *scratch* block past `num_blocks`
that the block pool never hands out: padded rows write there.

Under tensor parallelism every rank runs its own runner on the same steps (executor/): the
model is the rank's shard, the cache holds only its KV heads (`model.num_kv_heads`), and only
rank 0 gets logits back (`execute_model` returns None on the other ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.rotary import head_dim_of
from pagedllm.worker.block_table import BlockTable
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.decode_graphs import DecodeGraphs


@dataclass
class ModelRunnerOutput:
    # One float32 row per scheduled sequence with sample=True, in scheduled order.
    sample_logits: torch.Tensor
    # seq_id -> float32 [len(token_ids), vocab] for scheduled sequences with all_logits=True.
    all_logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ModelInput:
    """The tensors of one step (batch in decodes-first order) and where the logits rows are."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_rows: list[int]  # hidden rows to project to logits
    sample_indices: list[int]  # per sampled sequence (scheduled order): its row in the logits
    all_logits_slices: list[tuple[int, int, int]]  # (seq_id, first logits row, number of rows)
    # A decode-only step whose every sequence samples one row: it may run a compiled graph.
    decode_only: bool = False


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
    ) -> None:
        """`kv_cache_dtype`: the cache's storage dtype (layers/kv_cache_format.py); None: `dtype`."""
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
            num_blocks=num_blocks + (1 if compile_batch_sizes else 0),  # + the scratch block
            block_size=block_size,
            dtype=kv_cache_dtype or dtype,
            device=self.device,
        )
        max_len = max_model_len or int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
        self.block_table = BlockTable(-(-max_len // block_size) + 1)
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

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.cache_engine.kv_caches

    def prepare_input(self, scheduled: list[Any]) -> ModelInput:
        """Input ids, positions, slot mapping and attention metadata for a non-empty step."""
        B = self.block_size
        q_lens = [len(s.token_ids) for s in scheduled]
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        prefills = [i for i, n in enumerate(q_lens) if n != 1]
        order = decodes + prefills
        num_decodes = len(decodes)

        token_ids: list[int] = []
        lens, starts, ctx_lens, n_blocks_of, rows = [], [], [], [], []
        table = self.block_table
        table.begin_step()
        for i in order:
            s = scheduled[i]
            token_ids.extend(s.token_ids)
            ctx = s.start_pos + q_lens[i]
            n_blocks = -(-ctx // B)
            if q_lens[i] == 0:
                raise ValueError(f"Sequence {s.seq.seq_id} is scheduled with no tokens")
            if len(s.block_table) < n_blocks:
                raise ValueError(
                    f"Sequence {s.seq.seq_id}: block table has {len(s.block_table)} blocks, "
                    f"{n_blocks} needed for {ctx} tokens"
                )
            lens.append(q_lens[i])
            starts.append(s.start_pos)
            ctx_lens.append(ctx)
            n_blocks_of.append(n_blocks)
            rows.append(table.update(s.seq.seq_id, s.block_table))  # writes only new ids
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

        query_starts = query_starts_t.tolist()
        dev = self.device
        decode_block_tables = decode_context_lens = None
        if num_decodes:
            max_decode_blocks = -(-max(ctx_lens[:num_decodes]) // B)
            decode_block_tables = block_tables[:num_decodes, :max_decode_blocks].to(dev).contiguous()
            decode_context_lens = torch.tensor(ctx_lens[:num_decodes], dtype=torch.long, device=dev)
        prefill_tables = [
            block_tables[j, : n_blocks_of[j]].to(dev) for j in range(num_decodes, len(order))
        ]
        prefill_padded = None
        if num_decodes < len(order):
            max_prefill_blocks = max(n_blocks_of[num_decodes:])
            prefill_padded = block_tables[num_decodes:, :max_prefill_blocks].to(dev).contiguous()
        attn_metadata = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_size=B,
            num_decode_tokens=num_decodes,
            decode_block_tables=decode_block_tables,
            decode_context_lens=decode_context_lens,
            prefill_query_starts=query_starts[num_decodes:],
            prefill_query_lens=lens[num_decodes:],
            prefill_context_lens=ctx_lens[num_decodes:],
            prefill_block_tables=prefill_tables,
            prefill_block_tables_padded=prefill_padded,
        )

        # Logits rows: every row of an all_logits sequence (its last row doubles as its sample
        # row), the last row of the other sampled sequences.
        row_of = {i: query_starts[j] for j, i in enumerate(order)}  # scheduled idx -> first row
        logits_rows: list[int] = []
        sample_indices: list[int] = []
        all_logits_slices: list[tuple[int, int, int]] = []
        for i, s in enumerate(scheduled):
            first, n = row_of[i], q_lens[i]
            if s.all_logits:
                all_logits_slices.append((s.seq.seq_id, len(logits_rows), n))
                logits_rows.extend(range(first, first + n))
                if s.sample:
                    sample_indices.append(len(logits_rows) - 1)
            elif s.sample:
                sample_indices.append(len(logits_rows))
                logits_rows.append(first + n - 1)
        return ModelInput(
            input_ids=torch.tensor(token_ids, dtype=torch.long).to(dev),
            positions=positions.to(dev),
            attn_metadata=attn_metadata,
            logits_rows=logits_rows,
            sample_indices=sample_indices,
            all_logits_slices=all_logits_slices,
            decode_only=num_decodes == len(order) and not all_logits_slices and len(sample_indices) == len(order),
        )

    @torch.no_grad()
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        # Swaps before copies: a swap-out frees blocks a copy may fill; a copy may read a
        # block that was just swapped in.
        self.cache_engine.swap_out(list(getattr(scheduler_output, "blocks_to_swap_out", ())))
        self.cache_engine.swap_in(list(getattr(scheduler_output, "blocks_to_swap_in", ())))
        copies = getattr(scheduler_output, "block_copies", None)
        if copies:
            self.cache_engine.copy_blocks(list(copies))
        scheduled = list(scheduler_output.scheduled)
        if not scheduled:
            return ModelRunnerOutput(torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device))
        inp = self.prepare_input(scheduled)
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
        return ModelRunnerOutput(sample_logits=sample_logits, all_logits=all_logits)

    def run_model(self, inp: ModelInput) -> torch.Tensor | None:
        """float32 logits of the rows `inp.logits_rows`: from a compiled decode graph where one
        is ready for this step, else from the eager model (None on tensor-parallel ranks > 0)."""
        if inp.decode_only and self.decode_graphs is not None:
            md = inp.attn_metadata
            logits = self.decode_graphs.run(
                inp.input_ids, inp.positions, md.slot_mapping, md.decode_block_tables, md.decode_context_lens
            )
            if logits is not None:
                return logits  # decode-only: row i is sequence i, in scheduled order
        with torch.inference_mode():
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)
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
    def profile_run(self, num_tokens: int, num_logit_rows: int = 1) -> None:
        """A dummy forward of one `num_tokens`-token prefill and `num_logit_rows` logits rows:
        the activation peak of the largest step, for sizing the KV cache on a GPU. Writes garbage
        into the cache (the slots wrap around), so use it on a throwaway runner."""
        dev = self.device
        num_slots = self.cache_engine.num_blocks * self.block_size
        attn_metadata = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=dev) % num_slots,
            block_size=self.block_size,
            prefill_query_starts=[0],
            prefill_query_lens=[num_tokens],
            prefill_context_lens=[num_tokens],  # no cached context: the cache is only written
            prefill_block_tables=[torch.zeros(1, dtype=torch.long, device=dev)],
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        positions = torch.arange(num_tokens, dtype=torch.long, device=dev)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, attn_metadata)
            self.model.compute_logits(hidden[-num_logit_rows:])
