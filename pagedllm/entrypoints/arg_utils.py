"""Command-line flags for every engine knob, named as vLLM names them (`--block-size` ...)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from pagedllm.config import (
    SUPPORTED_ATTENTION_BACKENDS,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DEVICES,
    SUPPORTED_DTYPES,
    SUPPORTED_EXECUTOR_BACKENDS,
    SUPPORTED_KV_CACHE_DTYPES,
    SUPPORTED_PREEMPTION_MODES,
    SUPPORTED_QUANT_COMPUTE,
    SUPPORTED_RUNNERS,
    SUPPORTED_SCHEDULING_POLICIES,
    SUPPORTED_TASKS,
    EngineConfig,
)
from pagedllm.multimodal.limits import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MEDIA_FETCH_TIMEOUT_S,
)
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Add the engine's flags; `model_positional` also accepts the model as a positional."""
    g = parser.add_argument_group("engine")
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None,
                            help="model: folder, .gguf file or Hub id org/name[:QUANT]")
    g.add_argument("--model", default=None,
                   help="Hugging Face model folder, .gguf file, or Hub id org/name (org/name:Q4_K_M: "
                        "that GGUF of the repo) (default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder, .gguf file or Hub id (default: the model)")
    add_model_source_args(parser)
    g.add_argument("--dtype", default="auto", choices=SUPPORTED_DTYPES)
    g.add_argument("--device", default="auto", choices=SUPPORTED_DEVICES)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16, choices=SUPPORTED_BLOCK_SIZES)
    g.add_argument("--kv-cache-space", type=float, default=4.0, help="GiB of KV cache (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size")
    g.add_argument("--swap-space", type=float, default=EngineConfig.swap_space,
                   help="GiB of host memory for swapped-out KV blocks (0: no swap)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--max-num-encoder-input-tokens", type=int, default=0,
                   help="image inputs: embedding rows the vision encoder may compute per step "
                        "(0: max(max-num-batched-tokens, 16384))")
    g.add_argument("--encoder-cache-size", type=int, default=0,
                   help="image inputs: embedding rows the encoder cache holds (0: as above)")
    g.add_argument("--preemption-mode", default=None, choices=list(SUPPORTED_PREEMPTION_MODES),
                   help="force recompute or swap (default: swap groups, recompute singles)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that split every layer (worker processes / Ray actors); must divide "
                        "the attention heads (docs/tensor_parallel.md)")
    g.add_argument("--distributed-executor-backend", default="mp", choices=SUPPORTED_EXECUTOR_BACKENDS,
                   help="where tensor-parallel ranks 1..N-1 run: worker processes on this machine (mp) "
                        "or Ray actors on a Ray cluster (ray; pip install pagedllm[ray])")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="server: engine cores (full replicas) behind one API server")
    g.add_argument("--data-parallel-address", default=None,
                   help="Ray replicas: the address the API server binds the cores' "
                        "authenticated TCP sockets on (default: this node's IP)")
    g.add_argument("--quantization", "-q", default=None)
    g.add_argument("--quant-compute", default="auto", choices=SUPPORTED_QUANT_COMPUTE,
                   help="integer-weight layers: exact float32 arithmetic or int8 activations "
                        "(auto: int8 for AWQ/GPTQ/compressed-tensors, exact for GGUF)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=SUPPORTED_KV_CACHE_DTYPES,
                   help="KV cache element type (auto: the model's dtype)")
    g.add_argument("--attention-backend", default="auto",
                   help=f"one of {list(SUPPORTED_ATTENTION_BACKENDS)}: auto = Triton kernels on CUDA, "
                        "the torch / C-kernel path on CPU")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs nor compile, even with --compile-batch-sizes")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every layer's blocks for the whole sequence even in models that mix "
                        "sliding-window and full attention (default: sliding layers keep only their window)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (docs/speculative_decoding.md)')
    g.add_argument("--cuda-graph-sizes", default=None,
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="GPU: comma-separated decode batch sizes to capture as CUDA graphs "
                        "(default: 1,2,4,8,16,24,... up to --max-num-seqs, at most 512)")
    g.add_argument("--compile-batch-sizes", default=None,
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="opt-in: comma-separated padded batch sizes of torch.compile'd decode "
                        "steps, e.g. 1,2,4,8 (default: none, every step eager)")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the server answers to; the first is the one it reports")
    g.add_argument("--scheduling-policy", default="fcfs", choices=list(SUPPORTED_SCHEDULING_POLICIES),
                   help="fcfs: arrival order (a request's non-zero priority is a 400); priority: "
                        "lower `priority` first, highest value preempted first")
    g.add_argument("--generation-config", default="auto",
                   help="auto: the model's generation_config.json sampling defaults; vllm: none; "
                        "or a folder holding a generation_config.json")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / prompt_logprobs per token a request may ask for "
                        "(-1: the whole vocabulary)")
    g.add_argument("--chat-template", default=None, help="a Jinja template, or a file holding one")
    g.add_argument("--structured-outputs-timeout", type=float, default=10.0,
                   help="seconds a request's structured-output constraint may take to compile "
                        "(in its own process); past it the request fails with a 400 (default 10)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT format) over the base model (docs/lora.md)")
    g.add_argument("--max-loras", type=int, default=1, help="adapters one batch may mix (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory (default: --max-loras)")
    g.add_argument("--runner", default="auto", choices=list(SUPPORTED_RUNNERS),
                   help="generate or pooling (embeddings, classification, scores; docs/pooling.md); auto: "
                        "pooling for an encoder or a headless *Model decoder")
    g.add_argument("--task", default=None, choices=list(SUPPORTED_TASKS),
                   help="vLLM's older spelling: embed / classify / score run the pooling runner")
    g.add_argument("--pooler-config", default=None,
                   help='pooling override as JSON, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' '
                        "(keys: pooling_type LAST|MEAN|CLS, normalize, dimensions, use_activation)")
    g.add_argument("--mm-processor-kwargs", default=None,
                   help='the model processor\'s settings, JSON, e.g. \'{"do_pan_and_scan": true}\' (Gemma 3)')
    g.add_argument("--limit-mm-per-prompt", default=None,
                   help='images one prompt may carry, JSON: \'{"image": 4}\' (default 999, as vLLM; '
                        "video and audio are not supported)")
    g.add_argument("--allowed-local-media-path", default="",
                   help="image_url file:// URLs are read only under this folder (default: none is read)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="image_url http(s):// URLs are fetched only from these hosts (default: none; "
                        "vLLM fetches from any)")
    g.add_argument("--media-fetch-timeout", type=float, default=DEFAULT_MEDIA_FETCH_TIMEOUT_S,
                   help="seconds one remote image may take to fetch, redirects included; past it the "
                        "request gets a 400 (default 5)")
    g.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help="largest encoded image taken, in bytes (default 20 MiB)")
    g.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="most pixels (width x height) of one image, checked before decoding "
                        "(default 4096 x 4096)")


MODEL_SOURCE_GROUP = "model source (Hugging Face Hub)"


def add_model_source_args(parser: argparse.ArgumentParser) -> None:
    """Where a Hub id's files come from (docs/model_ids.md); HF_HOME, HF_HUB_CACHE,
    HF_HUB_OFFLINE, HF_TOKEN and HF_ENDPOINT apply as huggingface_hub reads them."""
    g = parser.add_argument_group(MODEL_SOURCE_GROUP)
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit hash of the model's Hub repo (default: main)")
    g.add_argument("--tokenizer-revision", default=None,
                   help="branch, tag or commit of the tokenizer's Hub repo (default: the model's "
                        "revision for the model's own repo, else main)")
    g.add_argument("--download-dir", default=None,
                   help="Hugging Face cache folder to download into and read from (default: "
                        "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    g.add_argument("--gguf-file", default=None,
                   help="the .gguf file to load from the model's repo or folder (or write org/name:QUANT)")


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags (`pagedllm serve` and the api_server module)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", nargs="+", action="extend", default=None,
                   help="require 'Authorization: Bearer KEY' with one of these keys (also "
                        "$PAGEDLLM_API_KEY); /health and /metrics stay open")
    g.add_argument("--allowed-origins", type=json.loads, default=["*"],
                   help='CORS: JSON list of allowed origins (default ["*"])')
    g.add_argument("--allowed-methods", type=json.loads, default=["*"],
                   help='CORS: JSON list of allowed methods (default ["*"])')
    g.add_argument("--allowed-headers", type=json.loads, default=["*"],
                   help='CORS: JSON list of allowed headers (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (client certs)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="whether client certificates are required (ssl.CERT_*: 0, 1, 2)")
    g.add_argument("--root-path", default=None,
                   help="FastAPI root_path when the server sits behind a path-based proxy")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log each request (the default; kept for vLLM command lines)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request: its id, prompt (cut at --max-log-len) and parameters")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="most prompt characters / token ids shown per logged request")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no uvicorn access log line per HTTP request")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: prompt tokens served by "
                        "the prefix cache")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc and /openapi.json")
    g.add_argument("--disable-dashboard", action="store_true",
                   help="no /dashboard page and no /v1/internal/engine_state (docs/dashboard.md)")

    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='vLLM\'s flag, kept for its command lines: tool_choice "auto" is on without it '
                        "(the format is read from the chat template; docs/tool_calling.md)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format, instead of the one read from the chat "
                        "template: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.x), generic (any "
                        "model: replies constrained to an answer-or-calls JSON envelope)")
    g.add_argument("--tool-call-any-whitespace", action="store_true",
                   help="let constrained tool-call JSON hold any whitespace (default: the canonical "
                        "separators only, so small models do not spend their budget on it)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into reasoning_content (deepseek_r1, qwen3)")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds that in-flight requests may take to finish after SIGTERM "
                        "(new ones get 503 meanwhile); then the server exits 0")
    g.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body taken; a larger one gets a 413 before it is "
                        "parsed (default 8 MiB)")
    g.add_argument("--request-header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's head; then it "
                        "is closed (default 10)")
    g.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive after its head; then "
                        "it gets a 408 (default 30)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat template sent with a request (chat_template); "
                        "without this flag such a request gets a 400")
    g.add_argument("--chat-template-render-timeout", type=float, default=5.0,
                   help="seconds a request's own chat template may take to render; then it "
                        "is stopped and the request gets a 400 (default 5)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served as models: name=path, or vLLM's JSON form "
                        '{"name": ..., "path": ..., "base_model_name": ...} (needs --enable-lora)')
    g.add_argument("--disable-responses-store", action="store_true",
                   help="keep no /v1/responses responses (no GET / DELETE, no "
                        "previous_response_id); responses come back with store: false")
    g.add_argument("--responses-store-max-entries", type=int, default=10_000,
                   help="most responses the /v1/responses store keeps; the least recently "
                        "used go first (default 10000)")
    g.add_argument("--responses-store-max-bytes", type=int, default=256 * 1024 * 1024,
                   help="most bytes (JSON) the /v1/responses store keeps (default 256 MiB)")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also turned on by "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")


def validate_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {args.port}.")
    if not args.host:
        raise ValueError("host must not be empty.")
    if getattr(args, "drain_timeout", 0) < 0:
        raise ValueError(f"drain_timeout must be at least 0 seconds, got {args.drain_timeout}.")
    max_body = getattr(args, "max_request_body_bytes", 1)
    if max_body <= 0:
        raise ValueError(f"--max-request-body-bytes must be a positive number of bytes, got "
                         f"{max_body}.")
    for name in ("request_header_timeout", "request_body_timeout",
                 "chat_template_render_timeout"):
        value = getattr(args, name, 1.0)
        if not value > 0:  # nan too
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of "
                             f"seconds, got {value}.")
    for name in ("responses_store_max_entries", "responses_store_max_bytes"):
        value = getattr(args, name, 1)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, name, ["*"])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"--{name.replace('_', '-')} must be a JSON list of strings, "
                             f"got {value!r}.")
    keyfile, certfile = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if bool(keyfile) != bool(certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both).")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile),
                       ("--ssl-ca-certs", getattr(args, "ssl_ca_certs", None))):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file.")
    if getattr(args, "disable_log_requests", False) and getattr(args, "enable_log_requests", False):
        raise ValueError("--disable-log-requests and --enable-log-requests contradict each other.")
    if getattr(args, "max_log_len", None) is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be at least 0, got {args.max_log_len}.")
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora.")


def server_extras_from_args(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """The served LoRA modules (each a local directory) and the tool / reasoning settings;
    checked (ValueError) before any engine core starts."""
    # lazy: both import fastapi, which `pagedllm --help` and the offline commands never need
    from pagedllm.entrypoints.openai.lora_models import parse_lora_modules
    from pagedllm.entrypoints.openai.tool_calling import ToolConfig

    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))
    for module in lora_modules:
        if not os.path.isdir(module.path):
            raise ValueError(f"--lora-modules {module.name}={module.path}: not a local directory.")
    tool_config = ToolConfig(
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        any_whitespace=getattr(args, "tool_call_any_whitespace", False))
    return lora_modules, tool_config


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; a chat template given as a file path is read here."""
    kwargs: dict[str, Any] = {}
    for name in (
        "tokenizer", "dtype", "device", "seed", "max_model_len", "block_size", "kv_cache_space",
        "gpu_memory_utilization", "num_kv_blocks", "swap_space", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
        "preemption_mode", "tensor_parallel_size", "distributed_executor_backend", "data_parallel_size", "data_parallel_address", "quantization", "quant_compute", "kv_cache_dtype",
        "attention_backend", "enforce_eager", "disable_hybrid_kv_cache_manager", "cuda_graph_sizes",
        "compile_batch_sizes", "num_threads", "served_model_name", "chat_template",
        "scheduling_policy", "generation_config", "max_logprobs", "structured_outputs_timeout",
        "revision", "tokenizer_revision", "download_dir", "gguf_file", "speculative_config",
        "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "runner", "task", "pooler_config",
        "max_num_encoder_input_tokens", "encoder_cache_size",
        "limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path", "allowed_media_domains", "media_fetch_timeout",
        "max_image_bytes", "max_image_pixels",
    ):
        kwargs[name] = getattr(args, name)
    positional, model = getattr(args, "model_tag", None), args.model
    if positional and model and positional != model:
        raise ValueError(f"Two models given: {positional!r} (positional) and --model {model!r}.")
    model = positional or model
    if kwargs["chat_template"]:
        path = Path(kwargs["chat_template"])
        if path.is_file():
            kwargs["chat_template"] = path.read_text()
    return EngineConfig(model=model, **kwargs)
