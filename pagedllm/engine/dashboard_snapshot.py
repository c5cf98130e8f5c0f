"""The engine-state snapshot: what the dashboard, `LLM.engine_state()` and `kv_map` draw.

Two halves, because two processes know them: the core's (`core_engine_state`: the memory
configuration, block states run-length encoded, each queued request and its block tables,
the scheduler and prefix-cache counters), made between two steps by the utility call
`engine_state` and only when asked; and the front end's (`add_request_timings`: time to first
token, inter-token latency and the caller's request id, which only the output processor
knows). docs/dashboard.md gives the JSON schema; `SNAPSHOT_VERSION` changes with it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_snapshot import (
    BLOCK_STATES,
    block_states,
    count_states,
    host_block_states,
    rle_encode,
    sequence_entry,
)

if TYPE_CHECKING:
    from pagedllm.core.request import SequenceState
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.output_processor import OutputProcessor

SNAPSHOT_VERSION = 1


def memory_config(core: "EngineCore") -> dict[str, Any]:
    """The settings that decide what fits in the KV pool."""
    cfg, kv = core.config, core.kv_cache_manager
    groups = kv.groups if len(kv.groups) > 1 or kv.is_hybrid else ()
    return {
        "model": core.model_name,
        "block_size": core.block_size,
        "num_blocks": kv.num_blocks,
        "num_host_blocks": core.num_host_blocks,
        "kv_cache_dtype": str(core.kv_cache_dtype).removeprefix("torch."),
        "bytes_per_block": core.bytes_per_block,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": core.max_model_len,
        "max_num_batched_tokens": core.max_num_batched_tokens,
        "swap_space_gib": cfg.swap_space,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "kv_cache_groups": ["full" if g.sliding_window is None else
                            f"sliding_window={g.sliding_window}" for g in groups],
    }


def _request_state(seqs: list["SequenceState"]) -> str:
    statuses = {s.status.value for s in seqs}
    for name in ("running", "swapped", "waiting"):
        if name in statuses:
            return name
    return "finished"


def core_engine_state(core: "EngineCore") -> dict[str, Any]:
    """The core's half of the snapshot (plain JSON data). Runs between steps."""
    t0 = time.perf_counter()
    sched, kv = core.scheduler, core.kv_cache_manager
    states, groups = block_states(kv)
    host = host_block_states(kv)
    queues: dict[str, list[str]] = {"running": [], "waiting": [], "swapped": []}
    seqs_of: dict[str, list[SequenceState]] = {}
    for name, seqs in (("running", sched.running), ("waiting", sched.waiting),
                       ("swapped", [s for g in sched.swapped for s in g])):
        for seq in seqs:
            if seq.request_id not in seqs_of:
                seqs_of[seq.request_id] = []
            if seq.request_id not in queues[name]:
                queues[name].append(seq.request_id)
            seqs_of[seq.request_id].append(seq)
    requests = []
    for rid, seqs in seqs_of.items():
        state = core.requests.get(rid)
        entries = [sequence_entry(s, kv) for s in sorted(seqs, key=lambda s: s.index)]
        device_blocks = {b for e in entries if not e["on_host"]
                         for t in e["block_tables"] for b in t if b >= 0}
        host_blocks = {b for e in entries if e["on_host"] for t in e["block_tables"] for b in t
                       if b >= 0}
        requests.append({
            "id": rid,
            "state": _request_state(seqs),
            "priority": seqs[0].priority,
            "arrival_time": seqs[0].arrival_time,
            "first_scheduled_time": state.first_scheduled_time if state else None,
            "num_prompt_tokens": len(seqs[0].prompt_token_ids),
            "num_output_tokens": sum(len(s.output_token_ids) for s in seqs),
            "num_cached_tokens": seqs[0].num_cached_tokens,
            "num_preemptions": sum(s.num_preemptions for s in seqs),
            "num_blocks": len(device_blocks),
            "num_host_blocks": len(host_blocks),
            "n": len(seqs),
            "is_beam_search": bool(state is not None and state.beam is not None),
            # Image inputs: each image's prompt span [start, end) and its content hash's head;
            # the page marks the blocks the span fills.
            "image_spans": [[f.start, f.end, f.content_hash.hex()[:12]] for f in seqs[0].mm_features],
            "seqs": entries,
        })
    return {
        "version": SNAPSHOT_VERSION,
        "engine_index": core.engine_index,
        "timestamp": time.time(),
        "config": memory_config(core),
        "block_states": list(BLOCK_STATES),
        "blocks": {"rle": rle_encode(states), "counts": count_states(states),
                   "groups_rle": rle_encode(groups) if groups is not None else None},
        "host_blocks": {"rle": rle_encode(host), "counts": count_states(host)},
        "counters": {
            "num_running": len(queues["running"]),
            "num_waiting": len(queues["waiting"]),
            "num_swapped": len(queues["swapped"]),
            "kv_used_blocks": kv.num_usable_blocks - kv.num_free_blocks,
            "kv_shared_blocks": kv.num_shared_blocks,
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_swapped_out_blocks": kv.num_swapped_out,
            "num_swapped_in_blocks": kv.num_swapped_in,
            "num_steps": core.counters.num_steps,
            "num_batched_tokens_total": core.counters.num_batched_tokens_total,
            "mm_cache_queries": sched.encoder_cache.queries,
            "mm_cache_hits": sched.encoder_cache.hits,
            "mm_images_encoded": sched.encoder_cache.images_encoded,
            "encoder_cache_rows": sched.encoder_cache.used,
        },
        "queues": queues,
        "requests": requests,
        "build_ms": round((time.perf_counter() - t0) * 1000, 3),  # what it cost the core
    }


def add_request_timings(snapshot: dict[str, Any], outputs: "OutputProcessor",
                        now: float | None = None) -> dict[str, Any]:
    """Fill in each request's caller id, TTFT and mean ITL from the front end's records."""
    now = time.time() if now is None else now
    for req in snapshot.get("requests", ()):
        state = outputs.requests.get(req["id"])
        req["request_id"] = state.request_id if state is not None else req["id"]
        ttft = itl = None
        if state is not None:
            m = state.metrics
            if m.first_token_time is not None:
                ttft = m.first_token_time - m.arrival_time
                longest = max((len(s.token_ids) for s in state.samples.values()), default=0)
                if m.last_token_time is not None and longest > 1:
                    itl = (m.last_token_time - m.first_token_time) / (longest - 1)
        req["ttft_s"] = ttft
        req["itl_s"] = itl
    snapshot["served_at"] = now
    return snapshot
