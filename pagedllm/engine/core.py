"""EngineCore: the scheduler, the KV cache manager, the model runner and the sampler.

Token ids in (`EngineCoreRequest`), token deltas out (`EngineCoreOutputs`, one per step):
schedule (proposals, then core/scheduler) -> plan (engine/step_planner: the frozen StepPlan) ->
execute and sample (executor -> worker/model_runner, on its persistent batch) -> update (append
tokens, check EOS / stop ids / lengths, free finished sequences). It never tokenizes or detokenizes: text is the front end's (`engine/output_processor.py`), which also
checks stop strings and tells the core which samples they ended (`finish_samples`). A pooling
model's core (engine/core_pooling.py) runs the same step; its requests finish after their
prompt with a pooled vector (`EngineCoreOutput.pooled`) instead of a sampled token.

One class serves both homes of the engine: in process under the offline `LLMEngine`, and in
its own process behind the server (`engine/core_process.py`, over ZeroMQ). Single-threaded.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Iterable

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import check_priority
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.step_plan import StepPlan
from pagedllm.engine.beam_search import beam_completions
from pagedllm.engine.core_stats import CoreCounters
from pagedllm.engine.core_model import start_model
from pagedllm.engine.core_pooling import CorePooling, PoolingState, check_request_kind
from pagedllm.engine.core_startup import (compile_batch_sizes, draft_max_model_len, draft_model_config, eos_token_ids,
                                          scheduler_config)
from pagedllm.engine.core_messages import (CoreStats, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                           SampleDelta)
from pagedllm.engine.errors import STALL_STEPS, EngineFatalError, SchedulerStallError
from pagedllm.engine.dashboard_snapshot import core_engine_state
from pagedllm.engine.input_processing import InputProcessor
from pagedllm.engine.kv_stats import KVCacheStats
from pagedllm.engine.request_state import RequestState
from pagedllm.engine.sequence_maker import SequenceMaker
from pagedllm.engine.sequence_update import SequenceUpdater
from pagedllm.engine.speculation import Speculation
from pagedllm.engine.step_planner import StepPlanner
from pagedllm.kernels.status import log_kernel_status
from pagedllm.layers.kv_cache_dtype import resolve_kv_cache_dtype
from pagedllm.layers.sampler import Sampler
from pagedllm.lora.core_registry import CoreLoRAs, check_lora_enabled
from pagedllm.lora.request import LoRARequest
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.model.resolution import ModelResolution, model_resolution
from pagedllm.model_source import ModelSource, resolve_tokenizer_source
from pagedllm.multimodal.checks import check_mm_features
from pagedllm.tokenizer import load_tokenizer
from pagedllm.worker.device import resolve_device, resolve_dtype
from pagedllm.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    """add_request / abort_requests / finish_samples / step, on token ids."""

    stall_steps = STALL_STEPS  # the watchdog's threshold (engine/errors.py)

    def __init__(self, config: EngineConfig, engine_index: int = 0, resolution: ModelResolution | None = None):
        self.config = config
        self.engine_index = engine_index
        t0 = time.perf_counter()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.resolution = resolution or model_resolution(config)  # before any load
        self.source: ModelSource = self.resolution.source
        self.model_name = (config.served_model_names or [self.source.name])[0]
        # A pooling model (docs/pooling.md): the same core; its requests finish after the prompt.
        self.pooling = CorePooling(config, self.resolution) if self.resolution.is_pooling else None
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.hf_config = self.resolution.hf_config
        self.vocab_size = int(self.hf_config.vocab_size)
        spec = SpeculativeConfig.from_value(config.speculative_config)
        self.draft = (draft_model_config(config, self.hf_config, spec)
                      if spec is not None and spec.method == "draft_model" else None)
        parts = start_model(config, self.source, self.hf_config, self.dtype, self.device, self.kv_cache_dtype,
                            self.draft, self.pooling)
        self.executor, self.max_model_len = parts.executor, parts.max_model_len
        self.model = self.executor.model  # rank 0's (its shard under tensor parallelism)
        self.block_size, self.kv_cache_groups = config.block_size, parts.kv_cache_groups
        self.bytes_per_block, self.num_host_blocks = parts.bytes_per_block, parts.num_host_blocks
        self.num_blocks, self.memory_profile = parts.num_blocks, parts.memory_profile

        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, self.block_size,
            enable_caching=config.enable_prefix_caching if self.pooling is None else self.pooling.prefix_caching,
            num_host_blocks=self.num_host_blocks, groups=self.kv_cache_groups)
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens(self.max_model_len)
        self.scheduler = Scheduler(scheduler_config(config, self.max_num_batched_tokens, self.max_model_len,
                                                    self.hf_config, self.pooling), self.kv_cache_manager)
        # Every rank: its runner, the same number of blocks of its own KV heads, the host pool.
        self.executor.initialize_cache(self.num_blocks, self.num_host_blocks, self.max_model_len,
                                       compile_batch_sizes(config, self.device))
        self.model_runner = self.executor.model_runner  # rank 0's
        if self.model_runner.decode_graphs is not None:
            self.model_runner.decode_graphs.request_all()  # in the background, smallest first
        self.sampler = Sampler()  # prompt logprobs (the runner samples the tokens)
        self.eos_token_ids = eos_token_ids(self.hf_config, self.model, self.source, self._load_tokenizer,
                                           generates=self.pooling is None)
        # The core validates again what the front end validated (a request from another
        # process is not trusted); it needs no tokenizer for token ids.
        self.inputs = InputProcessor(None, self.vocab_size, self.max_model_len,
                                     self.scheduler.check_request_fits,
                                     max_logprobs=config.max_logprobs,
                                     scheduling_policy=config.scheduling_policy,
                                     max_num_seqs=config.max_num_seqs)
        self.updater = SequenceUpdater(self.eos_token_ids, self.max_model_len)
        # Grammars, allowed_token_ids, bad_words: the tokenizer is loaded on first use.
        self.structured = StructuredOutputManager(
            self._load_tokenizer, self.vocab_size, sorted(self.eos_token_ids),
            compile_timeout_s=config.structured_outputs_timeout)
        self.requests: dict[str, RequestState] = {}
        # Speculative decoding: proposals before the schedule, statistics and back-off after.
        self.speculation: Speculation | None = None
        if spec is not None:
            self.speculation = Speculation(
                spec, self.requests, self.structured, self.max_model_len, self.max_num_batched_tokens,
                draft_max_model_len=None if self.draft is None else draft_max_model_len(self.draft, spec,
                                                                                       self.max_model_len),
                has_draft_model=self.draft is not None)
        # Multi-LoRA: the adapters rank 0's runner holds, pinned in host memory while requests use them.
        self.loras: CoreLoRAs | None = None
        if config.enable_lora:
            self.loras = CoreLoRAs(self.model_runner.lora)
        self.planner = StepPlanner(self.requests, self.structured,
                                   None if self.speculation is None else self.speculation.proposer, self.loras)
        self.sequences = SequenceMaker(self.scheduler, self.planner, self.eos_token_ids)
        self._idle_steps = 0  # the watchdog's count (see `stall_steps`)
        self.counters = CoreCounters(self.scheduler, self.kv_cache_manager, config.max_loras, self.loras,
                                     self.speculation)
        self.startup_seconds = time.perf_counter() - t0
        log_kernel_status(self.device)  # which path runs: the C kernels or plain torch
        logger.info("Engine core ready in %.1f s (%s, %s)", self.startup_seconds, self.device,
                    self.dtype)

    def _load_tokenizer(self):
        tok_source = resolve_tokenizer_source(self.config, self.source)
        return load_tokenizer(tok_source.path, tok_source.gguf_file)

    # ---- requests -------------------------------------------------------------------------

    def check_request(self, request: EngineCoreRequest) -> list[int]:
        """Validate a tokenized request (a ValueError: it can never run); its prompt ids."""
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        check_priority(request.priority, self.config.scheduling_policy)
        check_lora_enabled(self.loras, request.lora_request)
        prompt_ids = self.inputs.check_token_ids(request.prompt_token_ids)
        check_mm_features(request.mm_features, len(prompt_ids), self.resolution.mm_config is not None,
                          self.scheduler.encoder_cache, self.max_num_batched_tokens, self.model_name)
        check_request_kind(request.pooling_params is not None, self.pooling is not None, self.model_name)
        if self.pooling is not None:
            self.pooling.check(prompt_ids, request.pooling_params, request.token_type_ids)
            self.scheduler.check_request_fits(len(prompt_ids))
        else:
            self.inputs.validate(prompt_ids, request.sampling_params)
        return prompt_ids

    def start_compile(self, request: EngineCoreRequest) -> "Future[Any] | None":
        """Validate; start compiling its grammar off this thread (the busy loop's path): None
        when it has none, else the compiled grammar's future for `add_request`."""
        self.check_request(request)
        return None if self.pooling is not None else self.structured.submit_compile(request.sampling_params)

    def add_request(self, request: EngineCoreRequest, grammar: Any = None) -> None:
        """Validate and queue a tokenized request; one that can never run is a ValueError.
        `grammar`: its compiled grammar from `start_compile`; else it is compiled here."""
        request_id = request.request_id
        params = request.sampling_params
        prompt_ids = self.check_request(request)
        if self.pooling is not None:
            return self._add_pooling(request, prompt_ids)
        beam_params = request.beam_params
        if params.use_beam_search and beam_params is None:
            from pagedllm.engine.beam_search import beam_params_from_sampling

            beam_params = beam_params_from_sampling(params, params.max_tokens)
        constraint = self.structured.constraint_for(params, grammar)  # a bad grammar: ValueError
        lora = check_lora_enabled(self.loras, request.lora_request)
        if lora is not None:  # loaded and checked once (a bad adapter: ValueError), then pinned
            self.loras.acquire(lora)
        try:
            state = self.sequences.new_request_state(request, prompt_ids, beam_params, constraint, lora)
        except BaseException:
            if lora is not None:
                self.loras.release(lora.lora_int_id)
            raise
        # The commit: up to here nothing was held; a failure from here on is fatal.
        self.requests[request_id] = state
        try:
            self.scheduler.add_sequence(state.seqs[0], lockstep=beam_params is not None)
        except BaseException as exc:
            raise EngineFatalError(f"adding request {request_id} to the scheduler failed: "
                                   f"{exc!r}") from exc

    def _add_pooling(self, request: EngineCoreRequest, prompt_ids: list[int]) -> None:
        """A pooling request: one sequence, finished by its prompt's last step (_update)."""
        params = self.pooling.check(prompt_ids, request.pooling_params, request.token_type_ids)
        state = RequestState(request.request_id, prompt_ids, None, request.arrival_time, priority=request.priority,
                             pooling=PoolingState(params, request.token_type_ids or []))
        state.seqs.append(self.sequences.make(state, 0, request.cache_salt))
        self.requests[request.request_id] = state
        self.scheduler.add_sequence(state.seqs[0])

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are; their blocks return to the pool at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            state = self.requests.get(rid)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED)
                seq.grammar = None  # frees the grammar state now
            self._drop_request(rid)
        self.counters.observe_kv_usage()  # kv_cache_stats() shows the freed blocks at once

    def finish_samples(self, samples: Iterable[tuple[str, int]]) -> None:
        """The front end saw a stop string end these (request id, sample index) samples: free
        them now; a request whose samples are all finished leaves the core."""
        for rid, index in samples:
            state = self.requests.get(rid)
            if state is None:
                continue
            for seq in state.seqs:
                if seq.index == index and not seq.is_finished:
                    self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED)
                    seq.grammar = None
            if state.finished:
                self._drop_request(rid)
        self.counters.observe_kv_usage()

    def _drop_request(self, rid: str) -> None:
        """The one place a request leaves the core (finished, stopped by a string, aborted):
        the proposer forgets its sequences (suffix decoding: their per-sequence trees)."""
        state = self.requests.pop(rid)
        if self.speculation is not None:
            for seq in state.seqs:
                self.speculation.proposer.on_finished(seq)
        if state.lora_request is not None:
            self.loras.release(state.lora_request.lora_int_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One step: schedule -> execute -> update; an output for every request that advanced."""
        sched_out = self._schedule()
        plan = self.planner.plan(sched_out)  # frozen from here on
        started = time.time()
        runner_out = self._execute(plan)
        return self._update(sched_out, plan, runner_out, started)

    def _schedule(self) -> SchedulerOutput:
        """The running decodes' proposals, then the scheduler's decision (watched for stalls)."""
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running, self.counters.num_steps)
        sched_out = self.scheduler.schedule()
        self._watch_progress(sched_out)
        return sched_out

    def _execute(self, plan: StepPlan) -> ModelRunnerOutput | None:
        """The plan on every rank (None: nothing to run, not even a table to drop)."""
        if not plan.has_work:
            return None
        t0 = time.perf_counter()
        runner_out = self.executor.execute_model(plan)
        if self.speculation is not None and plan.sequences:
            self.speculation.observe_step_time(plan, time.perf_counter() - t0)
        return runner_out

    def _update(self, sched_out: SchedulerOutput, plan: StepPlan, runner_out: ModelRunnerOutput | None,
                started: float) -> EngineCoreOutputs:
        """Tokens computed, sampled tokens appended, finished requests out."""
        if not sched_out.scheduled:
            return EngineCoreOutputs(timestamp=time.time(), engine_index=self.engine_index)
        outputs: dict[str, EngineCoreOutput] = {}
        for item in sched_out.scheduled:
            state = self.requests[item.seq.request_id]
            if state.first_scheduled_time is None:
                state.first_scheduled_time = started
                state.num_cached_tokens = item.seq.num_cached_tokens
                outputs[state.request_id] = EngineCoreOutput(
                    state.request_id, [], first_scheduled_time=started,
                    num_cached_tokens=item.seq.num_cached_tokens,
                )
        self.counters.on_step(sched_out.num_batched_tokens)
        num_accepted = runner_out.num_accepted if runner_out is not None else {}
        self.scheduler.update_after_step(sched_out, num_accepted)
        if self.speculation is not None:
            self.speculation.after_step(sched_out, plan, num_accepted)
        self.counters.observe_kv_usage()
        self._process_outputs(sched_out, plan, runner_out, outputs)
        self.counters.observe_kv_usage()  # finished sequences gave their blocks back
        # Every entry carries something: a first scheduling (cache hits, queue time), tokens,
        # prompt logprobs, or a finished beam search.
        for rid, out in outputs.items():
            state = self.requests.get(rid)
            if state is not None and state.finished:
                out.finished = True
                if state.beam is not None:
                    out.beam_completions = state.beam_outputs or []
                self._drop_request(rid)
        return EngineCoreOutputs(list(outputs.values()), timestamp=time.time(),
                                 engine_index=self.engine_index)

    def _watch_progress(self, sched_out: SchedulerOutput) -> None:
        """The watchdog: raise `SchedulerStallError` naming the stuck requests when
        `stall_steps` steps in a row had work but scheduled nothing and moved no block."""
        if sched_out.scheduled or sched_out.has_cache_ops or not self.requests:
            self._idle_steps = 0
            return
        self._idle_steps += 1
        if self._idle_steps >= self.stall_steps:
            self._idle_steps = 0
            sched, kv = self.scheduler, self.kv_cache_manager
            raise SchedulerStallError(
                list(self.requests), self.stall_steps,
                f"running {sched.num_running}, waiting {sched.num_waiting}, swapped "
                f"{sched.num_swapped}; free blocks {kv.num_free_blocks}/{kv.num_blocks}, free "
                f"host blocks {kv.num_free_host_blocks}",
            )

    def _output_for(self, outputs: dict[str, EngineCoreOutput], rid: str) -> EngineCoreOutput:
        out = outputs.get(rid)
        if out is None:
            out = outputs[rid] = EngineCoreOutput(rid, [])
        return out

    def _process_outputs(self, sched_out: SchedulerOutput, plan: StepPlan, runner_out: ModelRunnerOutput,
                         outputs: dict[str, EngineCoreOutput]) -> None:
        """Append the runner's sampled tokens (`runner_out.sampled`: one row per sampled
        sequence in scheduled order, an n > 1 sequence's forks after it at its first sample);
        beams get their logits row (`sample_logits`, one per sampling item)."""
        sampled = runner_out.sampled
        r = 0  # the next row of `sampled`
        sample_i = 0  # the next row of `sample_logits`
        for item, step in zip(sched_out.scheduled, plan.sequences):
            state = self.requests[item.seq.request_id]
            if step.pool:  # a pooling model's prompt: its vector once the last rows are in
                vec = self.pooling.collect(state.pooling, item.start_pos, runner_out.pooled_hidden[step.seq_id],
                                           item.sample)
                if vec is not None:
                    self.scheduler.finish_sequence(item.seq, SequenceStatus.FINISHED_STOPPED)
                    self._output_for(outputs, state.request_id).pooled = vec
                continue
            if step.all_logits:
                entries = self.updater.add_prompt_logprobs(
                    state, item, runner_out.all_logits[item.seq.seq_id], self.sampler
                )
                if entries:
                    out = self._output_for(outputs, state.request_id)
                    out.new_prompt_logprobs = (out.new_prompt_logprobs or []) + entries
            if not item.sample:
                continue
            if state.beam is not None:
                # A copy: a view would keep the step's whole logits tensor alive.
                state.beam.add_logits(item.seq, runner_out.sample_logits[sample_i].clone())
                sample_i += 1
                if state.beam.ready():
                    self._advance_beams(state)
                    if state.finished:  # beam search reports once, at the end
                        self._output_for(outputs, state.request_id)
                continue
            sample_i += 1 + len(item.draft_token_ids)
            if item.draft_token_ids:
                accepted = runner_out.num_accepted.get(item.seq.seq_id, 0)
                self.speculation.observe_verified(item.seq.seq_id, len(item.draft_token_ids), accepted,
                                                  self.counters.num_steps)
                r = self._append_verified(state, item, sampled, r, accepted, outputs)
                continue
            targets = [item.seq]
            if state.params.n > 1 and not state.forked:
                # First sample of an n > 1 request: fork n - 1 children that share the
                # prompt's blocks; the runner drew each one's first token from the same logits.
                targets += [self.sequences.fork_sample(state, item.seq, idx) for idx in range(1, state.params.n)]
                state.forked = True
            out = self._output_for(outputs, state.request_id)
            for seq in targets:
                token, logprob, status, stop_reason = self.updater.append_token(
                    state, seq, sampled, r)
                r += 1
                delta = SampleDelta(seq.index, [token], [logprob] if logprob is not None else None)
                if status is not None:
                    self.scheduler.finish_sequence(seq, status)
                    delta.finish_reason = status.finish_reason
                    delta.stop_reason = stop_reason
                out.samples.append(delta)

    def _append_verified(self, state: RequestState, item, sampled, r: int, accepted: int,
                         outputs: dict[str, EngineCoreOutput]) -> int:
        """A decode with draft tokens: its accepted drafts and the token after them, in
        order, until one ends the sequence (the rest are dropped); the next row of `sampled`."""
        seq = item.seq
        delta = SampleDelta(seq.index, [], [] if state.params.logprobs is not None else None)
        for i in range(accepted + 1):
            token, logprob, status, stop_reason = self.updater.append_token(state, seq, sampled, r + i)
            delta.new_token_ids.append(token)
            if delta.new_logprobs is not None:
                delta.new_logprobs.append(logprob)
            if status is not None:
                self.scheduler.finish_sequence(seq, status)
                delta.finish_reason = status.finish_reason
                delta.stop_reason = stop_reason
                break
        self._output_for(outputs, state.request_id).samples.append(delta)
        return r + accepted + 1

    def _advance_beams(self, state: RequestState) -> None:
        """One beam-search step for a request whose running beams all have their logits."""
        beam = state.beam
        assert beam is not None
        done = beam.advance(
            fork=lambda parent: self.sequences.fork_beam(state, parent),
            drop=lambda seq: self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED),
        )
        state.seqs = list(beam.running)
        if done:
            state.beam_outputs = beam_completions(beam.search.results(), state,
                                                  self.eos_token_ids)

    # ---- statistics -----------------------------------------------------------------------

    def stats(self) -> CoreStats:
        return self.counters.stats()

    def kv_cache_stats(self) -> KVCacheStats:
        return self.counters.kv_cache_stats()

    def reset_kv_cache_peak(self) -> None:
        self.counters.reset_kv_cache_peak()

    def engine_state(self) -> dict[str, Any]:
        """The block map, queues and block tables now (engine/dashboard_snapshot.py): made only when
        asked, between steps (the dashboard's poll is a utility call)."""
        return core_engine_state(self)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the grammar compiler now (they would also
        leave with this process)."""
        self.structured.shutdown()
        self.executor.shutdown()

    def utility(self, name: str, args: list[Any]) -> Any:
        """The calls a front end in another process may make (besides requests)."""
        if name not in ("reset_prefix_cache", "reset_kv_cache_peak", "kv_cache_stats",
                        "engine_state", "add_lora",
                        "remove_lora", "list_loras", "pin_lora"):
            raise ValueError(f"Unknown engine core call {name!r}.")
        return getattr(self, name)(*args)

    # ---- LoRA adapters (docs/lora.md): vLLM's add_lora / remove_lora / list_loras / pin_lora --

    def add_lora(self, lora: LoRARequest | dict) -> bool:
        """Load an adapter into host memory now; a bad one: ValueError."""
        lora = check_lora_enabled(self.loras, lora if isinstance(lora, LoRARequest) else LoRARequest(**lora))
        return self.loras.add(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already running with it finish."""
        return False if self.loras is None else self.loras.remove(int(lora_int_id))

    def list_loras(self) -> list[int]:
        return [] if self.loras is None else self.loras.list()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter in host memory until removed."""
        return False if self.loras is None else self.loras.pin(int(lora_int_id))
