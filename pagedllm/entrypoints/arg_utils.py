"""Command-line flags for every engine knob, named as vLLM names them (`--block-size` ...)."""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.config import SUPPORTED_BLOCK_SIZES, SUPPORTED_DEVICES, SUPPORTED_DTYPES, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine's flags; `model_positional` also accepts the model as a positional."""
    g = parser.add_argument_group("engine")
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, help="model (folder or .gguf)")
    g.add_argument("--model", default=None,
                   help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder/.gguf (default: the model)")
    g.add_argument("--dtype", default="auto", choices=SUPPORTED_DTYPES)
    g.add_argument("--device", default="auto", choices=SUPPORTED_DEVICES)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16, choices=SUPPORTED_BLOCK_SIZES)
    g.add_argument("--kv-cache-space", type=float, default=4.0, help="GiB of KV cache (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size")
    g.add_argument("--swap-space", type=float, default=0.0, help="GiB of host swap space")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--preemption-mode", default=None, choices=["recompute"])
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--quantization", "-q", default=None)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--chat-template", default=None, help="a Jinja template, or a file holding one")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; a chat template given as a file path is read here."""
    kwargs: dict[str, Any] = {}
    for name in (
        "tokenizer", "dtype", "device", "seed", "max_model_len", "block_size", "kv_cache_space",
        "gpu_memory_utilization", "num_kv_blocks", "swap_space", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
        "preemption_mode", "tensor_parallel_size", "quantization", "enforce_eager",
        "num_threads", "served_model_name", "chat_template",
    ):
        kwargs[name] = getattr(args, name)
    model = getattr(args, "model_tag", None) or args.model
    if kwargs["chat_template"]:
        from pathlib import Path

        path = Path(kwargs["chat_template"])
        if path.is_file():
            kwargs["chat_template"] = path.read_text()
    return EngineConfig(model=model, **kwargs)
