"""CUDA graphs for decode steps (GPU, `enforce_eager=False`, the default there).

Why: a decode step of a small model is hundreds of small kernel launches whose CPU cost exceeds
their GPU time; a captured graph replays them all with one launch. Each batch-size bucket
(`capture_sizes`: 1, 2, 4, 8, then every multiple of 8 up to `max_num_seqs`, at most 512, as vLLM
captures) is captured once at start-up, largest first so that the smaller ones reuse its memory
pool. A decode-only step of `n` sequences replays the smallest bucket `>= n` over persistent input
buffers, padded (worker/padded_decode.py: scratch block, fixed table width); steps with
prefills, with prompt logprobs, or above the largest bucket run eager.

What a captured step may not do: synchronise with the host or size anything from tensor values.
The Triton attention backend (layers/backends/triton_paged.py) is written for that (grid and
split-K from shapes only); the torch backend is not (it reads the longest context to the host),
so graphs are captured only over the Triton backend (worker/model_runner.py decides).

The capture itself is a function `capture(fn, pool) -> CapturedGraph`: `capture_cuda_graph` on a
GPU; the unit tests pass one that re-runs `fn` at replay, which checks the buffers, the padding and
the output slicing on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.worker.padded_decode import DecodeStep, StaticDecodeInputs, bucket_for

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's default largest captured batch


def capture_sizes(max_num_seqs: int, configured: Sequence[int] | None = None) -> list[int]:
    """The buckets: the configured sizes up to `max_num_seqs` (a larger one could never be used),
    or 1, 2, 4, 8, 16, 24, ... up to `max_num_seqs` (and `max_num_seqs` itself), at most 512."""
    if configured:
        sizes = sorted({int(b) for b in configured if int(b) <= max_num_seqs})
        return sizes or [max_num_seqs]
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))
    if top not in sizes:
        sizes.append(top)
    return sizes


@dataclass
class CapturedGraph:
    replay: Callable[[], None]
    output: torch.Tensor  # written by every replay
    pool: Any  # the memory pool the next capture shares


def capture_cuda_graph(fn: Callable[[], torch.Tensor], pool: Any) -> CapturedGraph:
    """Capture `fn` (already warmed up: Triton kernels compiled, cuBLAS handles made) as a graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return CapturedGraph(graph.replay, output, graph.pool())


class CudaGraphRunner:
    """Captured decode steps per bucket over persistent inputs (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        batch_sizes: Sequence[int],
        device: torch.device,
        capture: Callable[[Callable[[], torch.Tensor], Any], CapturedGraph] = capture_cuda_graph,
    ) -> None:
        if not batch_sizes:
            raise ValueError("CudaGraphRunner needs at least one batch size")
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.kv_caches = kv_caches
        self.device = device
        self.step_module = DecodeStep(model, block_size)
        self.inputs = StaticDecodeInputs(max(self.batch_sizes), -(-max_model_len // block_size), block_size,
                                         scratch_block, device)
        self._capture = capture
        self._graphs: dict[int, CapturedGraph] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0  # device memory the captures took (the shared pool)
        self.steps_run = 0  # decode steps served by a graph
        self.padded_rows = 0  # rows of those steps that were padding

    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(self.batch_sizes, num_seqs)

    def _step(self, bucket: int) -> Callable[[], torch.Tensor]:
        views = self.inputs.views(bucket)

        def step() -> torch.Tensor:
            with torch.inference_mode():
                hidden = self.step_module.model(*views[:2], self.kv_caches, self._metadata(views))
            # Outside inference mode: the logits are ordinary tensors the sampler may modify.
            return self.step_module.model.compute_logits(hidden)

        return step

    def _metadata(self, views: tuple[torch.Tensor, ...]) -> AttentionMetadata:
        ids, _, slots, tables, ctx = views
        return AttentionMetadata(slot_mapping=slots, block_size=self.step_module.block_size,
                                 num_decode_tokens=ids.shape[0], decode_block_tables=tables,
                                 decode_context_lens=ctx)

    @torch.no_grad()
    def capture_all(self, warmup_runs: int = 2) -> None:
        """Capture every bucket, largest first (one shared pool); log the time and memory taken.
        Dummy rows only touch the scratch block."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        pool = None
        for bucket in reversed(self.batch_sizes):
            step = self._step(bucket)
            for _ in range(warmup_runs):  # compiles the Triton kernels of this shape, outside capture
                step()
            if cuda:
                torch.cuda.synchronize(self.device)
            graph = self._capture(step, pool)
            pool = graph.pool
            self._graphs[bucket] = graph
        if cuda:
            torch.cuda.synchronize(self.device)
            self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        self.capture_seconds = time.perf_counter() - t0
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.2f GiB",
                    len(self.batch_sizes), _sizes_text(self.batch_sizes), self.capture_seconds,
                    self.pool_bytes / (1 << 30))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor | None:
        """Logits `[n, vocab]` of a decode-only step replayed from its bucket's graph; None above
        the largest bucket or before capture (the caller runs eager). The rows are a view of the
        graph's output: valid until the next replay."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        graph = self._graphs.get(bucket) if bucket is not None else None
        if graph is None:
            return None
        self.inputs.fill(input_ids, positions, slot_mapping, block_tables, context_lens, bucket)
        graph.replay()
        self.steps_run += 1
        self.padded_rows += bucket - n
        return graph.output[:n]


def _sizes_text(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
