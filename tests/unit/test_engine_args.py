"""Every engine flag of `pagedllm serve` / `generate` reaches EngineConfig (a flag parsed and then
dropped is a knob silently ignored: `--distributed-executor-backend` once was)."""

from __future__ import annotations

import argparse

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.arg_utils import add_engine_args, engine_config_from_args

# A valid value other than the default for every flag (the CLI spelling, the expected field value).
NON_DEFAULT = {
    "model": (["--model", "/some/model"], "/some/model"),
    "tokenizer": (["--tokenizer", "/some/tok"], "/some/tok"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "device": (["--device", "cpu"], "cpu"),
    "seed": (["--seed", "7"], 7),
    "max_model_len": (["--max-model-len", "512"], 512),
    "block_size": (["--block-size", "32"], 32),
    "kv_cache_space": (["--kv-cache-space", "1.5"], 1.5),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "num_kv_blocks": (["--num-kv-blocks", "64"], 64),
    "swap_space": (["--swap-space", "1"], 1.0),
    "max_num_seqs": (["--max-num-seqs", "8"], 8),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "1024"], 1024),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"], False),
    "preemption_mode": (["--preemption-mode", "swap"], "swap"),
    "tensor_parallel_size": (["-tp", "3"], 3),
    "distributed_executor_backend": (["--distributed-executor-backend", "ray"], "ray"),
    "data_parallel_size": (["-dp", "2"], 2),
    "quantization": (["--quantization", "gptq"], "gptq"),
    "quant_compute": (["--quant-compute", "exact"], "exact"),
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], "fp8"),
    "attention_backend": (["--attention-backend", "triton"], "triton"),
    "enforce_eager": (["--enforce-eager"], True),
    "disable_hybrid_kv_cache_manager": (["--disable-hybrid-kv-cache-manager"], True),
    "speculative_config": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
                           '{"method": "ngram", "num_speculative_tokens": 3}'),
    "cuda_graph_sizes": (["--cuda-graph-sizes", "1,2,4"], [1, 2, 4]),
    "compile_batch_sizes": (["--compile-batch-sizes", "1,2"], [1, 2]),
    "num_threads": (["--num-threads", "2"], 2),
    "served_model_name": (["--served-model-name", "m"], "m"),
    "chat_template": (["--chat-template", "{{ x }}"], "{{ x }}"),
    "scheduling_policy": (["--scheduling-policy", "priority"], "priority"),
    "generation_config": (["--generation-config", "vllm"], "vllm"),
    "max_logprobs": (["--max-logprobs", "-1"], -1),
    "structured_outputs_timeout": (["--structured-outputs-timeout", "2.5"], 2.5),
    "data_parallel_address": (["--data-parallel-address", "10.0.0.5"], "10.0.0.5"),
    "enable_lora": (["--enable-lora"], True),
    "max_loras": (["--max-loras", "3"], 3),
    "max_lora_rank": (["--max-lora-rank", "64"], 64),
    "max_cpu_loras": (["--max-cpu-loras", "4"], 4),
    "runner": (["--runner", "pooling"], "pooling"),
    "task": (["--task", "embed"], "embed"),
    "pooler_config": (["--pooler-config", '{"normalize": false}'], '{"normalize": false}'),
    "max_num_encoder_input_tokens": (["--max-num-encoder-input-tokens", "4096"], 4096),
    "encoder_cache_size": (["--encoder-cache-size", "8192"], 8192),
    "limit_mm_per_prompt": (["--limit-mm-per-prompt", '{"image": 2}'], {"image": 2}),
    "mm_processor_kwargs": (["--mm-processor-kwargs", '{"do_pan_and_scan": true}'], {"do_pan_and_scan": True}),
    "allowed_local_media_path": (["--allowed-local-media-path", "/tmp"], "/tmp"),
    "allowed_media_domains": (["--allowed-media-domains", "Example.com", "b.org"], ["example.com", "b.org"]),
    "media_fetch_timeout": (["--media-fetch-timeout", "2.5"], 2.5),
    "max_image_bytes": (["--max-image-bytes", "1000"], 1000),
    "max_image_pixels": (["--max-image-pixels", "4096"], 4096),
}


def _engine_group_dests(parser: argparse.ArgumentParser) -> set[str]:
    group = next(g for g in parser._action_groups if g.title == "engine")
    return {a.dest for a in group._group_actions}


def test_every_engine_flag_has_a_case_here():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert _engine_group_dests(parser) == set(NON_DEFAULT)


def test_every_engine_flag_reaches_the_config():
    for name, (argv, expected) in NON_DEFAULT.items():
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        args = parser.parse_args(argv)
        if name == "compile_batch_sizes":
            args.tensor_parallel_size = 1
        config = engine_config_from_args(args)
        assert getattr(config, name) == expected, name
        assert getattr(EngineConfig(), name) != expected, f"{name}: the case must differ from the default"
