"""Compiled decode steps: the whole model (and LM head) per padded batch size, via torch.compile.

Opt-in (`compile_batch_sizes`). Why it exists: eager float32 GEMMs through MKL are slow at
decode batch sizes, and inductor's GEMM choices on frozen weights (max-autotune: its C++ GEMM
templates or prepacked MKL) beat them on AVX2 machines (../shared/PERF-NOTES.md). Why it is off
by default: the hand-written kernels (kernels/packed_gemm.c, paged_decode_attention.c) made the
eager step as fast as these graphs on this project's machines, without ~40 s of compilation and
~0.7 GB of repacked weights per batch size (benchmarks/NOTES.md). Under torch.compile the
projections take inductor's path, not the C GEMM. Shapes must be static, so a decode-only step
of `n` sequences runs in the graph of the smallest `bucket >= n`, padded in persistent buffers
(worker/padded_decode.py, shared with the CUDA graphs of worker/cuda_graphs.py).

Attention stays one opaque custom op (`pagedllm::paged_decode_attention`), so the graph has no
data-dependent shapes. Graphs compile in one background thread, most wanted first: a step whose
bucket is not ready runs eager, so start-up is not held up by compilation (tens of seconds per
bucket on 2 cores; inductor's on-disk caches make later start-ups faster). Steps with prefills,
with `all_logits` (prompt logprobs) or larger than the largest bucket always run eager.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.layers.eager_in_graphs import prepare_for_compilation
from pagedllm.worker.padded_decode import DecodeStep, StaticDecodeInputs, bucket_for

logger = logging.getLogger(__name__)

# Inductor settings that make the CPU decode step fast (measured, benchmarks/NOTES.md).
INDUCTOR_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}


class DecodeGraphs:
    """Compiled decode graphs per batch-size bucket, compiled in the background on demand."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        batch_sizes: Sequence[int],
        device: torch.device,
    ) -> None:
        if not batch_sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.table_width = -(-max_model_len // block_size)
        self.step_module = DecodeStep(model, block_size)
        # Dynamo keeps one cache entry per static shape; leave room for every bucket.
        import torch._dynamo  # lazy: torch._dynamo / inductor (about 1 s) only when compiling

        prepare_for_compilation()

        limit = len(self.batch_sizes) + 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 8 * limit
        )
        self._compiled: dict[int, nn.Module] = {}  # bucket -> ready compiled module
        self._queue: list[int] = []
        self._in_progress: int | None = None
        self._failed: dict[int, str] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.compile_seconds: dict[int, float] = {}
        self.steps_run = 0  # decode steps served by a compiled graph
        self.padded_rows = 0  # rows of those steps that were padding
        self.inputs = StaticDecodeInputs(max(self.batch_sizes), self.table_width, block_size, scratch_block, device)

    # ---- scheduling of compilations -------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(self.batch_sizes, num_seqs)

    def request(self, bucket: int, urgent: bool = False) -> None:
        """Queue `bucket` for compilation (first in line when urgent); no-op if done or queued."""
        with self._cond:
            if self._closed or bucket in self._compiled or bucket in self._failed or bucket == self._in_progress:
                return
            if bucket in self._queue:
                if not urgent:
                    return
                self._queue.remove(bucket)
            self._queue.insert(0, bucket) if urgent else self._queue.append(bucket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="pagedllm-compile", daemon=True)
                self._thread.start()
                atexit.register(self.close)
            self._cond.notify_all()

    def request_all(self) -> None:
        for b in self.batch_sizes:
            self.request(b)

    def ready(self, bucket: int) -> bool:
        return bucket in self._compiled

    def wait(self, buckets: Sequence[int] | None = None, timeout: float | None = None) -> bool:
        """Block until `buckets` (default: all) are compiled or failed; True if all compiled."""
        wanted = list(self.batch_sizes if buckets is None else buckets)
        for b in reversed(wanted):
            self.request(b, urgent=True)  # ahead of the background queue, in the given order
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not all(b in self._compiled or b in self._failed for b in wanted):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return all(b in self._compiled for b in wanted)

    def close(self) -> None:
        """Drop queued compilations and wait for the one in progress: a compile thread killed
        at interpreter exit inside inductor aborts the process."""
        with self._cond:
            self._queue.clear()
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                bucket = self._in_progress = self._queue.pop(0)
            t = time.perf_counter()
            try:
                module = self._compile(bucket)
            except Exception as exc:  # a failed compile leaves that bucket eager, loudly
                logger.warning("Compiling the decode step for batch %d failed; it stays eager: %r", bucket, exc)
                with self._cond:
                    self._failed[bucket] = repr(exc)
                    self._in_progress = None
                    self._cond.notify_all()
                continue
            with self._cond:
                self.compile_seconds[bucket] = time.perf_counter() - t
                self._compiled[bucket] = module
                self._in_progress = None
                self._cond.notify_all()
            logger.info("Decode step for batch %d compiled in %.1f s", bucket, self.compile_seconds[bucket])

    def _compile(self, bucket: int) -> nn.Module:
        # The settings go into inductor's global config for the duration of the compilation
        # (the first call): passed as `torch.compile(options=...)` freezing does not take
        # effect (weights stay graph inputs and no GEMM template applies).
        # lazy: torch._dynamo / inductor (about 1 s) only when compiling
        import torch._inductor.config as inductor_config

        with inductor_config.patch(INDUCTOR_OPTIONS):
            return self._compile_now(bucket)

    def _compile_now(self, bucket: int) -> nn.Module:
        compiled = torch.compile(self.step_module, dynamic=False)
        # The first call compiles. The dummy rows of a fresh bucket only touch the scratch block;
        # its own static inputs, not the shared buffers (a step may be filling them meanwhile).
        inputs = StaticDecodeInputs(bucket, self.table_width, self.block_size, self.scratch_block,
                                    self.device).views(bucket)
        with torch.no_grad():
            compiled(*inputs, self.kv_caches)
        return compiled

    # ---- running ----------------------------------------------------------------------------
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits `[n, vocab]` of a decode-only step from its compiled graph; None if that graph
        is not ready yet (it is then requested, first in line) and the caller runs eager."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None:
            return None
        module = self._compiled.get(bucket)
        if module is None:
            self.request(bucket, urgent=True)
            return None
        inputs = self.inputs.fill(input_ids, positions, slot_mapping, block_tables, context_lens, bucket)
        with torch.no_grad():
            logits = module(*inputs, self.kv_caches)
        self.steps_run += 1
        self.padded_rows += bucket - n
        return logits[:n]
