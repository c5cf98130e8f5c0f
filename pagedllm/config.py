"""EngineConfig: every engine knob in one place, validated once.

The same names are used by `LLM(...)` keyword arguments and by the CLI flags (with dashes), as
vLLM names them, so that a user's vLLM command line carries over.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.generation_defaults import check_generation_config
from pagedllm.multimodal.limits import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MEDIA_FETCH_TIMEOUT_S,
    check_media_knobs,
    parse_limit_mm_per_prompt,
    parse_mm_processor_kwargs,
)

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
SUPPORTED_DEVICES = ("auto", "cpu", "cuda")
SUPPORTED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
# None: auto-detected from config.json's quantization_config (docs/quantization.md)
SUPPORTED_QUANTIZATION: tuple[str, ...] = ("gguf", "gptq", "awq", "compressed-tensors")
SUPPORTED_PREEMPTION_MODES = ("recompute", "swap")
# KV cache element type: "auto" = the model's dtype (float32 on CPU); bfloat16 halves the cache,
# int8 (per-(block, head) scales) quarters it (docs/kv_cache.md).
# fp8 (= fp8_e4m3) / fp8_e5m2: one byte per element with a float32 scale per KV head and layer
# (1.0 unless the checkpoint has k_scale / v_scale), as vLLM's; the Triton backend on GPUs, the
# torch path elsewhere.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# How a layer reads and writes the paged cache (layers/backends): "auto" = the Triton kernels on
# CUDA (when triton is installed), the torch / C-kernel path on CPU.
SUPPORTED_ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Arithmetic of integer-weight layers (docs/quantization.md): "exact" unpacks to float32 and
# FMAs (equal to dequantize-then-matmul); "int8" quantizes activations to int8 per block of 32
# and multiplies in integers (AVX-512 VNNI / AVX2); "auto": int8 for AWQ/GPTQ/compressed-tensors
# checkpoints, exact for GGUF files (greedy parity with transformers is pinned there).
SUPPORTED_QUANT_COMPUTE = ("auto", "exact", "int8")
# Where tensor-parallel ranks 1..N-1 run: worker processes on this machine, or Ray actors.
SUPPORTED_EXECUTOR_BACKENDS = ("mp", "ray")
# vLLM's --scheduling-policy (core/scheduler_config.py)
SUPPORTED_SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --runner and its older --task spelling (docs/pooling.md)
SUPPORTED_RUNNERS = ("auto", "generate", "pooling")
SUPPORTED_TASKS = ("auto", "generate", "embed", "classify", "score")
# vLLM's allowed --max-lora-rank values (adapters of a smaller rank are zero-padded to it)
SUPPORTED_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class EngineConfig:
    """Engine construction arguments (see README "Every knob")."""

    model: str | None = None  # HF folder, .gguf file, Hub id (org/name[:QUANT]), or None: SmolLM2
    tokenizer: str | None = None  # a folder, .gguf file or Hub id; defaults to the model
    # Hugging Face Hub ids (docs/model_ids.md): the branch, tag or commit of the model repo;
    # of the tokenizer repo (default: the model's revision when the tokenizer is the model's
    # repo, else its main branch); the cache folder instead of huggingface_hub's (HF_HUB_CACHE,
    # $HF_HOME/hub); the GGUF file inside the repo or folder (as `org/name:QUANT` picks one).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"  # float32 on CPU, bfloat16 on GPU
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_space: float = 4.0  # GiB of KV cache on CPU
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # fixes the pool size (tests, benchmarks)
    # GiB of host memory for swapped-out blocks (vLLM's default 4). On CPU it is a separate
    # tensor whose pages cost memory only once a swap-out writes them. 0: no swap.
    swap_space: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_num_seqs)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Image inputs (docs/multimodal.md, core/encoder_cache.py): embedding rows the vision encoder
    # may compute per step, and rows the encoder cache holds; 0: max(max_num_batched_tokens, 16384).
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # None: swap out a preempted request with several running sequences (n > 1, beam
    # search), recompute a single one; "swap" / "recompute" force one for every preemption.
    preemption_mode: str | None = None
    # Ranks that split every layer (docs/tensor_parallel.md): worker processes on one machine
    # ("mp") or Ray actors ("ray", an optional extra) beside the engine core's rank 0.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # Server: engine cores behind one API server, each a full replica (engine/router.py).
    data_parallel_size: int = 1
    # Ray replicas: the address the API server binds the cores' (CURVE-authenticated) TCP
    # sockets on; None: this node's IP as Ray reports it.
    data_parallel_address: str | None = None
    quantization: str | None = None
    quant_compute: str = "auto"
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    # True: never compile or capture (overrides compile_batch_sizes and CUDA graphs).
    enforce_eager: bool = False
    # True: one block table for every layer even when the model mixes sliding-window and full
    # attention layers (docs/hybrid_kv_cache.md; vLLM's --disable-hybrid-kv-cache-manager).
    disable_hybrid_kv_cache_manager: bool = False
    # Speculative decoding (docs/speculative_decoding.md): vLLM's dict (or its JSON string),
    # e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}.
    speculative_config: Any = None
    # GPU: decode-only steps of up to these padded batch sizes replay captured CUDA graphs
    # (worker/cuda_graphs.py); None: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs
    # (at most 512), as vLLM captures.
    cuda_graph_sizes: list[int] | None = None
    # Opt-in (CPU): decode-only steps of up to these padded batch sizes run torch.compile'd graphs,
    # compiled in the background (eager until ready). Off by default: with the C kernels the
    # eager step is as fast here (benchmarks/NOTES.md) and compiling costs ~40 s and ~0.7 GB per size.
    compile_batch_sizes: list[int] | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    # The name(s) the server answers to (vLLM's --served-model-name NAME [NAME ...]): the first
    # is the one responses and /v1/models report; requests may use any of them.
    served_model_name: str | list[str] | None = None
    chat_template: str | None = None
    # vLLM's --scheduling-policy: "fcfs" (arrival order; a non-zero request priority is an
    # error) or "priority" (lower `priority` first, and preempted last; core/scheduler.py).
    scheduling_policy: str = "fcfs"
    # vLLM's --generation-config: "auto" (the model's generation_config.json sampling
    # defaults), "vllm" (none), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # vLLM's --max-logprobs: most logprobs (and prompt logprobs) a request may ask for per
    # token; a request's -1 means the whole vocabulary, allowed only when this is -1 too.
    max_logprobs: int = 20
    # Seconds a structured-output constraint may take to compile (in its own process,
    # structured_output/compiler_process.py); past it the request fails with a 400.
    structured_outputs_timeout: float = 10.0
    # Multi-LoRA (docs/lora.md), vLLM's knobs: adapters in PEFT's format served over the one
    # base model; `max_loras` run in one batch (slots), `max_cpu_loras` (default max_loras)
    # stay loaded in host memory (LRU), `max_lora_rank` bounds every adapter's rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Pooling models (docs/pooling.md): vLLM's --runner (auto: pooling for an encoder or a
    # headless `*Model` decoder, generation otherwise), its older --task spelling (embed /
    # classify / score -> pooling; generate), and --pooler-config (JSON: pooling_type,
    # normalize, dimensions, use_activation).
    runner: str = "auto"
    task: str | None = None
    pooler_config: Any = None
    # Image inputs (docs/multimodal.md), vLLM's knobs: images per prompt (limit_mm_per_prompt,
    # {"image": n} or its JSON; default 999, as vLLM), file:// images only under
    # allowed_local_media_path (""), http(s) images only from the hosts in allowed_media_domains
    # (None: no remote image, unlike vLLM, which fetches from anywhere), each fetch within
    # media_fetch_timeout seconds (vLLM's VLLM_IMAGE_FETCH_TIMEOUT) and max_image_bytes, each
    # image at most max_image_pixels (checked before decoding).
    limit_mm_per_prompt: Any = None
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    media_fetch_timeout: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    # vLLM's mm_processor_kwargs: settings for the model's processor, e.g. Gemma 3's
    # {"do_pan_and_scan": true} (a dict or its JSON; given to `from_pretrained`).
    mm_processor_kwargs: Any = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self._validate_model_source()
        if self.runner not in SUPPORTED_RUNNERS:
            raise ValueError(f"runner must be one of {list(SUPPORTED_RUNNERS)}, got {self.runner!r}.")
        if self.task is not None and self.task not in SUPPORTED_TASKS:
            raise ValueError(f"task must be one of {list(SUPPORTED_TASKS)}, got {self.task!r}.")
        if self.task not in (None, "auto") and self.runner != "auto":
            implied = "generate" if self.task == "generate" else "pooling"
            if implied != self.runner:
                raise ValueError(f"task={self.task!r} asks for the {implied} runner, but runner={self.runner!r}.")
        if self.pooler_config is not None:
            from pagedllm.pooling.pooler_config import parse_override  # lazy: imports torch

            parse_override(self.pooler_config)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {list(SUPPORTED_DTYPES)}, got {self.dtype!r}.")
        if self.device not in SUPPORTED_DEVICES:
            raise ValueError(f"device must be one of {list(SUPPORTED_DEVICES)}, got {self.device!r}.")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {list(SUPPORTED_BLOCK_SIZES)}, got {self.block_size}."
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space must be positive (GiB), got {self.kv_cache_space}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative (GiB), got {self.swap_space}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if self.preemption_mode is not None and self.preemption_mode not in SUPPORTED_PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {list(SUPPORTED_PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}."
            )
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory).")
        self._validate_tensor_parallel()
        if isinstance(self.data_parallel_size, bool) or not isinstance(self.data_parallel_size, int) \
                or self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be an integer of at least 1, got {self.data_parallel_size!r}."
            )
        if self.quantization is not None and self.quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(
                f"quantization={self.quantization!r} is not supported yet. Supported: "
                f"{list(SUPPORTED_QUANTIZATION)} (None: detected from the checkpoint's config.json)."
            )
        if self.quant_compute not in SUPPORTED_QUANT_COMPUTE:
            raise ValueError(f"quant_compute must be one of {list(SUPPORTED_QUANT_COMPUTE)}, "
                             f"got {self.quant_compute!r}.")
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(SUPPORTED_KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}.")
        if self.attention_backend not in SUPPORTED_ATTENTION_BACKENDS:
            hint = (" The flashinfer backend is not implemented in pagedllm; use 'triton' (the GPU default)."
                    if self.attention_backend == "flashinfer" else "")
            raise ValueError(f"attention_backend must be one of {list(SUPPORTED_ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}.{hint}")
        if self.cuda_graph_sizes is not None:
            if not self.cuda_graph_sizes or any(isinstance(b, bool) or int(b) != b or int(b) < 1
                                                for b in self.cuda_graph_sizes):
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive batch sizes, "
                                 f"got {self.cuda_graph_sizes!r}.")
        if self.compile_batch_sizes is not None:
            if not self.compile_batch_sizes or any(int(b) < 1 for b in self.compile_batch_sizes):
                raise ValueError(
                    f"compile_batch_sizes must be a non-empty list of positive batch sizes, "
                    f"got {self.compile_batch_sizes!r}."
                )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}.")
        if isinstance(self.served_model_name, (list, tuple)):
            names = list(self.served_model_name)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"served_model_name must be a non-empty name or list of names, "
                                 f"got {self.served_model_name!r}.")
            self.served_model_name = names[0] if len(names) == 1 else names
        if self.scheduling_policy not in SUPPORTED_SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of "
                             f"{list(SUPPORTED_SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}.")

        check_generation_config(self.generation_config)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: the whole vocabulary), "
                             f"got {self.max_logprobs!r}.")
        self._validate_lora()
        self.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        self.mm_processor_kwargs = parse_mm_processor_kwargs(self.mm_processor_kwargs)
        self.allowed_media_domains = check_media_knobs(
            self.allowed_local_media_path, self.allowed_media_domains, self.media_fetch_timeout,
            self.max_image_bytes, self.max_image_pixels)
        timeout = self.structured_outputs_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_timeout must be a positive number of seconds, "
                             f"got {timeout!r}.")

    def _validate_model_source(self) -> None:
        """What can be checked before looking at disk or the Hub (model_source.py does the rest)."""
        for name in ("model", "tokenizer", "revision", "tokenizer_revision", "download_dir", "gguf_file"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                setattr(self, name, value)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}.")
        if self.model is None:
            for name in ("revision", "gguf_file"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs a model (a Hub id or a local "
                                     "folder); the default model takes none.")
            if self.tokenizer is None and self.tokenizer_revision is not None:
                raise ValueError("tokenizer_revision needs a Hub model id or tokenizer id; the default "
                                 "model takes none.")
        if self.gguf_file is not None:
            if not self.gguf_file.lower().endswith(".gguf"):
                raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}.")
            if self.model is not None and self.model.lower().endswith(".gguf"):
                raise ValueError(f"gguf_file={self.gguf_file!r} names a file inside a folder or Hub repo; "
                                 f"the model {self.model!r} is already a .gguf file.")
        for name in ("revision", "tokenizer_revision"):
            value = getattr(self, name)
            if value is not None and any(c.isspace() for c in value):
                raise ValueError(f"{name} must be a branch, tag or commit hash without spaces, got {value!r}.")
        if self.download_dir is not None and os.path.isfile(os.path.expanduser(self.download_dir)):
            raise ValueError(f"download_dir {self.download_dir!r} is a file, not a folder.")

    def _validate_tensor_parallel(self) -> None:
        """What can be checked without the model (heads and GPUs are checked when it loads,
        before any worker starts: executor/create_executor)."""
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}.")
        if self.distributed_executor_backend not in SUPPORTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {list(SUPPORTED_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}.")
        if self.tensor_parallel_size > 1 and self.compile_batch_sizes and not self.enforce_eager:
            raise ValueError(f"compile_batch_sizes (compiled decode graphs) is not supported with "
                             f"tensor_parallel_size={self.tensor_parallel_size}; leave it unset or use "
                             "tensor_parallel_size=1.")

    def _validate_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_lora_rank not in SUPPORTED_MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {list(SUPPORTED_MAX_LORA_RANKS)} (as vLLM), "
                             f"got {self.max_lora_rank}.")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras ({cpu!r}) must be an integer of at least max_loras ({self.max_loras}).")
        if self.enable_lora and self.compile_batch_sizes:
            raise ValueError("compile_batch_sizes (compiled decode graphs) is not supported with enable_lora: "
                             "the graphs do not read the step's adapter indices; leave it unset.")

    @property
    def requested_runner(self) -> str:
        """"generate", "pooling" or "auto" (decided by the model's architecture)."""
        if self.task not in (None, "auto"):
            return "generate" if self.task == "generate" else "pooling"
        return self.runner

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments; an unknown name is a precise error, not ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"Unknown engine argument(s) {unknown}. Known: {sorted(names)}.")
        return cls(**kwargs)

    @property
    def served_model_names(self) -> list[str]:
        """Every served name, the reported one first (empty: the model's own name)."""
        if self.served_model_name is None:
            return []
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        return list(self.served_model_name)

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            return max(max_model_len, self.max_num_seqs)
        return max(2048, self.max_num_seqs)


ENGINE_ARG_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))
