"""Torch-free core: sequence state, block pool, KV cache manager and scheduler."""

from pagedllm.core.block_pool import BlockPool, FreeKVBlockQueue, KVBlock, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import SequenceState, SequenceStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_config import SchedulerConfig
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput

__all__ = [
    "BlockPool",
    "FreeKVBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SequenceState",
    "SequenceStatus",
    "hash_block_tokens",
]
