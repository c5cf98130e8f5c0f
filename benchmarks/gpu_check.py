"""The prepared device check of issue 13: one command, one JSON, one markdown table.

    bash benchmarks/gpu_check.sh            # on a lent H200: every stage, in under 8 minutes
    bash benchmarks/gpu_check.sh --smoke    # on a CPU: the same stages at tiny sizes (< 3 min)

Device time is scarce and nobody watches the run, so the parent process never touches CUDA: it runs
every stage in a child process of its own (`--stage NAME`), under a time budget, with its GPU memory
to itself (a stage's numbers must not depend on what an earlier stage left allocated). A child
writes its record to a JSON file after every step, so a stage that fails or is killed at its budget
still reports what it measured, with the traceback; the others run on. Budgets leave every later
stage its reserve, and the whole run ends before the deadline (`--deadline`, 450 s; stages that no
longer fit are recorded as skipped). The stages (docs/gpu_check.md):

1. `tests_triton`, `tests_gpu`: the Triton kernel tests on CUDA, then every other `gpu`-marked test.
2. `parity_bfloat16`, `parity_float32`: greedy tokens of pagedllm vs transformers on the same
   weights (SmolLM2-135M-Instruct when its weights are here, else a seeded random model of its exact
   config): the first divergence per prompt.
3. `throughput_eager`, `throughput_graphs`, `throughput_hf`: seed20, burst200 and sharegpt1000 on a
   random ~1B Llama (TinyLlama-1.1B's config), output tokens/s of pagedllm eager, pagedllm with
   CUDA graphs and transformers `generate`.
4. (in the two pagedllm throughput stages, on the same engines, before their workloads) the median
   step time of steady decode at batch 1 and 64 vs the HBM roofline (weight bytes / 4.3 TB/s).
5. `kv_blocks_0.5`, `oom`: the engine's KV blocks at gpu_memory_utilization 0.5 (the 0.9 row is
   throughput_graphs's engine: the defaults), and the errors for a utilization too small for the
   weights and a max_model_len too large for the memory.

Output: `$OUT/gpu_check.json`, `$OUT/gpu_check.md`, `$OUT/gpu_check.log` (OUT defaults to
./gpu_check_out). Nothing here is estimated: a figure that was not measured is absent, and says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/gpu_check.py` as well as `-m benchmarks.gpu_check`
    sys.path.insert(0, str(REPO))

HBM_BYTES_PER_S = 4.3e12  # the H200's device-to-device copy rate measured here (device/KINDS.md)
MODEL_ENV = "PAGEDLLM_GPU_CHECK_MODEL"  # an HF folder or .gguf of SmolLM2 (or "default") for parity
TRITON_TEST_FILES = ("tests/unit/test_triton_attention.py", "tests/unit/test_triton_int_gemm.py")
WORKLOAD_NAMES = ("seed20", "burst200", "sharegpt1000")

# SmolLM2-135M-Instruct as `pagedllm.model_source.load_hf_config(resolve_model(None))` reads it from
# the default GGUF (tests/unit/test_gpu_check.py checks it against that file where it is present).
SMOLLM2_CONFIG: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    hidden_act="silu", tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
# TinyLlama-1.1B's architecture (random weights): the ~1B model of the throughput and decode stages.
TINYLLAMA_CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
# The smoke run's model (CPU): the same code paths in seconds.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
LONG_CONTEXT = 1 << 20  # max_position_embeddings of the OOM stage's copy: its KV cannot fit the budget


@dataclass(frozen=True)
class StageSpec:
    name: str
    cap_s: float  # the most it may take
    reserve_s: float  # what earlier stages must leave it


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the H200 run and the CPU smoke run."""

    mode: str
    device: str
    deadline_s: float
    min_start_s: float  # a stage with less time than this left is skipped
    parity_config: dict[str, Any]
    bench_config: dict[str, Any]
    bench_dtype: str  # the dtype the ~1B model is saved and run in
    parity_prompts: int
    parity_new_tokens: int
    workload_limit: int | None  # requests per workload (None: all)
    max_tokens_cap: int | None  # output tokens per request (None: the workload's)
    hf_batch: int
    decode_batches: tuple[int, ...]
    decode_steps: int
    stages: tuple[StageSpec, ...]


def _stages(scale: float, caps: dict[str, tuple[float, float]]) -> tuple[StageSpec, ...]:
    return tuple(StageSpec(n, c * scale, r * scale) for n, (c, r) in caps.items())


# (cap, reserve) in seconds on the H200; the smoke run's are its own.
# The throughput stages measure decode (stage 4) on their engines first, and throughput_graphs's
# engine (the defaults: gpu_memory_utilization 0.9, CUDA graphs) is stage 5's 0.9 row.
_GPU_STAGES = {
    "models": (60, 15), "tests_triton": (110, 30), "tests_gpu": (40, 10),
    "parity_bfloat16": (45, 20), "parity_float32": (45, 20),
    "throughput_eager": (95, 45), "throughput_graphs": (100, 45), "throughput_hf": (75, 30),
    "kv_blocks_0.5": (45, 20), "oom": (45, 20),
}
_SMOKE_STAGES = {
    "models": (25, 5), "tests_triton": (50, 8), "tests_gpu": (25, 5),
    "parity_bfloat16": (25, 5), "parity_float32": (25, 5),
    "throughput_eager": (25, 5), "throughput_graphs": (25, 5), "throughput_hf": (25, 5),
    "kv_blocks_0.5": (20, 5), "oom": (25, 5),
}

FULL = Sizes(mode="full", device="cuda", deadline_s=450, min_start_s=12, parity_config=SMOLLM2_CONFIG,
             bench_config=TINYLLAMA_CONFIG, bench_dtype="bfloat16", parity_prompts=32, parity_new_tokens=64,
             workload_limit=None, max_tokens_cap=None, hf_batch=64, decode_batches=(1, 64), decode_steps=50,
             stages=_stages(1.0, _GPU_STAGES))
SMOKE = Sizes(mode="smoke", device="cpu", deadline_s=170, min_start_s=4, parity_config=TINY_CONFIG,
              bench_config=TINY_CONFIG, bench_dtype="float32", parity_prompts=4, parity_new_tokens=16,
              workload_limit=4, max_tokens_cap=12, hf_batch=4, decode_batches=(1, 4), decode_steps=8,
              stages=_stages(1.0, _SMOKE_STAGES))


# ---------------------------------------------------------------------------- pure helpers


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where `a` and `b` differ, None if they are equal. One ending
    earlier (an EOS) diverges at its length: a shorter output is a different output."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_summary(divs: Sequence[int | None]) -> dict[str, Any]:
    """Per prompt "equal" or the first differing index; the median and minimum are over the
    prompts that diverged (None when none did)."""
    diverged = [d for d in divs if d is not None]
    return {
        "num_prompts": len(divs),
        "num_equal": len(divs) - len(diverged),
        "median_first_divergence": statistics.median(diverged) if diverged else None,
        "min_first_divergence": min(diverged) if diverged else None,
        "per_prompt": ["equal" if d is None else d for d in divs],
    }


def cut_at_eos(tokens: Sequence[int], eos_ids: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (transformers pads after it, pagedllm stops)."""
    out: list[int] = []
    for t in tokens:
        out.append(int(t))
        if t in eos_ids:
            break
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def tree_hash(root: Path = REPO) -> str:
    """sha256 over the repo's Python sources: names the code that ran where no .git travels."""
    h = hashlib.sha256()
    for sub in ("pagedllm", "benchmarks", "tests"):
        for p in sorted((root / sub).rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- the record


class Record(dict):
    """A stage's findings, rewritten to its JSON file after every step (atomic replace), so a
    child killed at its budget leaves what it had."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=1, default=_json_default))
        os.replace(tmp, self.path)

    @contextmanager
    def step(self, key: str) -> Iterator[dict[str, Any]]:
        """A sub-measurement: its dict under `key`; an exception there is recorded (with the
        traceback) and the stage goes on with its next step."""
        sub: dict[str, Any] = self.setdefault(key, {})
        t0 = time.perf_counter()
        try:
            yield sub
        except Exception:  # noqa: BLE001 (a failing measurement is a result)
            sub["error"] = traceback.format_exc(limit=12)
            self.setdefault("errors", []).append(key)
        finally:
            sub["seconds"] = round(time.perf_counter() - t0, 2)
            self.save()


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


# ---------------------------------------------------------------------------- models


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def save_word_tokenizer(vocab_size: int, path: Path) -> None:
    """A word-level tokenizer with one token per id ("<t123>"), saved next to a random model: the
    engine needs a tokenizer, prompts are token ids, and every id detokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"<t{i}>": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.save_pretrained(path)


def save_random_llama(config: dict[str, Any], path: Path, dtype: str, device: str, seed: int) -> dict[str, Any]:
    """A seeded random Llama of `config`, saved with transformers' own save_pretrained (built on the
    device: a 1B model initialises there in a second), with a word-level tokenizer."""
    import torch
    import transformers as tf

    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    built_on = device
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**config))
    except Exception:  # noqa: BLE001 (slower on the CPU, but the later stages get their model)
        built_on = "cpu"
        torch.manual_seed(seed)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**config))
    model = model.to(_torch_dtype(dtype)).eval()
    model.save_pretrained(tmp)
    save_word_tokenizer(int(config["vocab_size"]), tmp)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    os.replace(tmp, path)
    return {"path": str(path), "params": n_params, "dtype": dtype, "seed": seed, "built_on": built_on,
            "seconds": round(time.perf_counter() - t0, 1)}


def long_context_copy(src: Path, dst: Path, max_position_embeddings: int) -> None:
    """`src` with a larger max_position_embeddings (weights linked, not copied): a max_model_len
    whose KV cache cannot fit, without a bigger model."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["max_position_embeddings"] = max_position_embeddings
            (tmp / f.name).write_text(json.dumps(cfg, indent=1))
        elif f.is_file():
            (tmp / f.name).symlink_to(f.resolve())
    os.replace(tmp, dst)


@dataclass
class Ctx:
    sizes: Sizes
    work: Path
    deadline: float  # this child's: time.perf_counter() value
    built: dict[str, Any] = dataclasses.field(default_factory=dict)  # the models this process built

    @property
    def device(self) -> str:
        return self.sizes.device

    @property
    def models(self) -> Path:
        return self.work / "models"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def ensure_model(self, name: str) -> Path:
        """The random model `name` ("parity", "bench", "bench_long"), built if an earlier stage did
        not (each build is seeded: the same weights whichever stage builds them)."""
        path = self.models / name
        if (path / "config.json").exists():
            return path
        self.models.mkdir(parents=True, exist_ok=True)
        if name == "parity":
            self.built[name] = save_random_llama(self.sizes.parity_config, path, "float32", self.device, seed=0)
        elif name == "bench":
            self.built[name] = save_random_llama(self.sizes.bench_config, path, self.sizes.bench_dtype, self.device,
                                                 seed=1)
        elif name == "bench_long":
            long_context_copy(self.ensure_model("bench"), path, LONG_CONTEXT)
        else:
            raise ValueError(f"unknown model {name!r}")
        return path


def parity_model(ctx: Ctx) -> tuple[Path, str, str]:
    """(HF folder, "real" | "random", what it is). Real SmolLM2 weights: $PAGEDLLM_GPU_CHECK_MODEL
    (a folder, a .gguf, or "default"), else (full run) the default GGUF if it is already in the cache
    (resolve_model(None) would try to download it: no network on the device). A GGUF is exported
    once to a dense HF folder, so that both engines run the same dense weights."""
    from pagedllm.model_source import DEFAULT_MODEL_FILE, cache_dir, resolve_model

    wanted = os.environ.get(MODEL_ENV)
    if not wanted and ctx.sizes.mode == "full" and (cache_dir() / DEFAULT_MODEL_FILE).exists():
        wanted = "default"
    if wanted:
        src = resolve_model(None if wanted == "default" else wanted)
        if src.is_gguf:
            from benchmarks.throughput import hf_export

            gguf = str(Path(src.path) / src.gguf_file)
            return Path(hf_export(gguf)), "real", f"{src.gguf_file} (exported to a dense HF folder)"
        return Path(src.path), "real", src.path
    return ctx.ensure_model("parity"), "random", "random weights of SmolLM2's config (seed 0)" \
        if ctx.sizes.mode == "full" else "random weights of the smoke run's tiny config (seed 0)"


PARITY_TEXTS = [
    "The capital of France is", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers:", "What is 17 times 23?", "Translate 'good morning' into Spanish.",
    "Once upon a time, in a small village,", "The three laws of thermodynamics are",
    "def fibonacci(n):", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Summarize the plot of Hamlet.", "The best way to learn a language is", "import numpy as np\n",
    "What causes earthquakes?", "Name the planets of the solar system.", "A good name for a cat is",
    "How do vaccines work?", "Describe the color red to someone who cannot see.", "SELECT * FROM users WHERE",
    "The history of the Roman Empire began", "Tips for a job interview:", "What is machine learning?",
    "My favourite book is", "Convert 100 degrees Fahrenheit to Celsius.", "Write a limerick about a dog.",
    "The quick brown fox", "Who painted the Mona Lisa?", "In 1969, humans first",
    "Three reasons to exercise are", "The difference between weather and climate is", "Hello, my name is",
]


def parity_prompts(ctx: Ctx, path: Path, kind: str) -> tuple[list[list[int]], str]:
    """Token-id prompts: the texts through the model's own tokenizer (real weights), or seeded random
    ids of 8..200 tokens (a random model)."""
    n = ctx.sizes.parity_prompts
    if kind == "real":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        texts = [PARITY_TEXTS[i % len(PARITY_TEXTS)] for i in range(n)]
        return [tok.encode(t) for t in texts], "text prompts through the model's tokenizer"
    rng = random.Random(0)
    vocab = int(ctx.sizes.parity_config["vocab_size"])
    hi = 200 if ctx.sizes.mode == "full" else 24
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, hi))] for _ in range(n)], \
        f"random token ids, 8..{hi} tokens"


# ---------------------------------------------------------------------------- measuring helpers


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def cuda_memory(device: str) -> dict[str, Any] | None:
    if device != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"free_gib": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2),
            "used_fraction": round((total - free) / total, 4),
            "torch_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
            "torch_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2)}


def graph_figures(llm) -> dict[str, Any] | None:
    """The CUDA-graph runner's public numbers (capture_seconds, pool_bytes, steps_run, ...), read
    with getattr: whatever the runner exposes, None where it has none."""
    runner = getattr(llm.llm_engine, "model_runner", None)
    graphs = getattr(runner, "cuda_graphs", None)
    if graphs is None and runner is not None:
        graphs = next((v for v in vars(runner).values() if hasattr(v, "capture_seconds")), None)
    if graphs is None:
        return None
    out: dict[str, Any] = {"class": type(graphs).__name__}
    for name in ("capture_seconds", "pool_bytes", "steps_run", "padded_rows", "batch_sizes"):
        value = getattr(graphs, name, None)
        if isinstance(value, (int, float, bool)) or (isinstance(value, list) and len(value) <= 600):
            out[name] = value
    return out


def engine_figures(llm) -> dict[str, Any]:
    """What the engine decided at start-up: blocks, their size, the memory profile it sized them by."""
    eng = llm.llm_engine
    core = eng.core
    per_block = core.bytes_per_block  # noqa: SLF001 (the number the pool was sized with)
    out = {"num_blocks": eng.num_blocks, "block_size": eng.block_size, "bytes_per_block": per_block,
           "kv_cache_gib": round(eng.num_blocks * per_block / 2**30, 3),
           "kv_tokens": eng.num_blocks * eng.block_size, "max_model_len": eng.max_model_len,
           "startup_s": round(float(getattr(eng, "startup_seconds", 0.0) or 0.0), 2),
           "attention_backend": str(eng.config.attention_backend),
           "attention_backend_resolved": _backend_name(core), "dtype": str(core.dtype),
           "kv_cache_dtype": str(core.kv_cache_dtype)}
    profile = getattr(core, "memory_profile", None)
    if profile is not None:
        out["memory_profile_gib"] = {k: round(v / 2**30, 3) for k, v in dataclasses.asdict(profile).items()}
    graphs = graph_figures(llm)
    if graphs is not None:
        out["cuda_graphs"] = graphs
    return out


def _backend_name(core) -> str | None:
    """The attention backend the engine chose ("auto" resolved), where the executor shows it."""
    backend = getattr(getattr(getattr(core, "executor", None), "driver", None), "attn_backend", None)
    return None if backend is None else str(getattr(backend, "name", None) or getattr(backend, "__name__", backend))


def make_llm(ctx: Ctx, model: Path, **kwargs: Any):
    from pagedllm import LLM

    kwargs.setdefault("device", ctx.device)
    kwargs.setdefault("seed", 0)
    if ctx.device == "cpu":
        kwargs.setdefault("kv_cache_space", 0.25)
        kwargs.setdefault("swap_space", 0.0)
    return LLM(str(model), **kwargs)


def drive(llm, reqs, limit_s: float, tag: str) -> dict[str, Any]:
    """All of `reqs` at once through the engine's own loop (LLM.generate's, with a time limit):
    output tokens/s over the run. Past `limit_s` the rest is aborted and the run marked incomplete
    (its rate then covers only what ran)."""
    from pagedllm import SamplingParams

    eng = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(reqs))]
    t0 = time.perf_counter()
    for rid, r in zip(ids, reqs):
        eng.add_request(rid, {"prompt_token_ids": r.prompt_token_ids},
                        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    last: dict[str, Any] = {}
    finished = 0
    complete = True
    while finished < len(ids):
        if time.perf_counter() - t0 > limit_s:
            complete = False
            eng.abort_request([rid for rid in ids if not (rid in last and last[rid].finished)])
            break
        for out in eng.step():
            last[out.request_id] = out
            finished += bool(out.finished)
        if finished < len(ids) and not eng.has_unfinished_requests():
            raise RuntimeError("the engine stopped with requests unfinished")
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in last.values())
    short = [i for i, (rid, r) in enumerate(zip(ids, reqs))
             if rid in last and last[rid].finished and len(last[rid].outputs[0].token_ids) != r.max_tokens]
    res = {"requests": len(reqs), "finished": finished, "complete": complete, "elapsed_s": round(elapsed, 3),
           "output_tokens": produced, "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
           "output_tokens_per_s": round(produced / elapsed, 1) if elapsed > 0 else None}
    if short:
        res["error"] = f"requests that finished short of max_tokens: {short[:10]}"
    return res


def bench_requests(ctx: Ctx, name: str) -> list:
    from benchmarks.workloads import BenchRequest, load_workload

    reqs = load_workload(name, int(ctx.sizes.bench_config["vocab_size"]), seed=0)
    if ctx.sizes.workload_limit is not None:
        reqs = reqs[: ctx.sizes.workload_limit]
    if ctx.sizes.max_tokens_cap is not None:
        reqs = [BenchRequest(r.prompt_token_ids, min(r.max_tokens, ctx.sizes.max_tokens_cap)) for r in reqs]
    return reqs


def _time_shares(ctx: Ctx, weights: dict[str, float], reserve: float = 3.0) -> Callable[[str], float]:
    """A time limit for each of several runs in order: the time left now, shared by weight among the
    runs not yet done (what one leaves unused goes to the next)."""
    pending = dict(weights)

    def limit(name: str) -> float:
        share = pending.pop(name) / (sum(pending.values()) + weights[name])
        return max(1.0, (ctx.left() - reserve) * share)

    return limit


# ---------------------------------------------------------------------------- the stages


def stage_models(ctx: Ctx, rec: Record) -> None:
    """Build the random models once (seeded) for the stages after; record the GPU."""
    import torch

    rec["torch"] = torch.__version__
    rec["torch_cuda"] = torch.version.cuda
    if ctx.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        rec["gpu"] = {"name": p.name, "total_memory_gib": round(p.total_memory / 2**30, 2),
                      "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count}
    rec.save()
    for name in ("parity", "bench", "bench_long"):
        with rec.step(name) as sub:
            t0 = time.perf_counter()
            sub["path"] = str(ctx.ensure_model(name))
            sub["build_s"] = round(time.perf_counter() - t0, 1)
            sub["built"] = ctx.built.get(name)
            cfg = json.loads((ctx.models / name / "config.json").read_text())
            sub["config"] = {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                     "num_key_value_heads", "intermediate_size", "vocab_size",
                                                     "max_position_embeddings", "tie_word_embeddings",
                                                     "torch_dtype", "dtype")}


PYTEST_SUMMARY = re.compile(r"(\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s|no tests ran)")


def run_pytest(ctx: Ctx, rec: Record, args: list[str], name: str) -> None:
    """pytest in a process group of its own, killed at the stage's budget. On CUDA, with
    pytest-xdist there (the device image has it), 8 workers compile the kernels in parallel; if
    that run breaks down (exit 2-4: interrupted, internal or usage error) it is run again without."""
    import importlib.util

    xml = ctx.work / f"junit_{name}.xml"
    log = ctx.work / f"pytest_{name}.txt"
    base = [sys.executable, "-m", "pytest", "-q", "-rfE", "--durations=10", "-p", "no:cacheprovider",
            f"--junitxml={xml}", *args]
    attempts = [base]
    if ctx.device == "cuda" and importlib.util.find_spec("xdist") is not None:
        attempts.insert(0, base[:3] + ["-n", "8"] + base[3:])
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the kernels compile for the GPU (tests set it where they want it)
    for i, cmd in enumerate(attempts):
        rec["command"] = " ".join(cmd[1:])
        rec.save()
        xml.unlink(missing_ok=True)
        timeout = max(5.0, ctx.left() - 3)
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd[1:])}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, process_group=0)
            try:
                rec["returncode"] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rec["returncode"] = None
                rec["timed_out_after_s"] = round(timeout, 1)
        if rec["returncode"] in (2, 3, 4) and i + 1 < len(attempts) and ctx.left() > 30:
            rec.setdefault("retried", []).append(f"exit code {rec['returncode']} with {' '.join(cmd[3:5])}")
            continue
        break
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    rec["summary"] = next((ln.strip("= ") for ln in reversed(lines) if PYTEST_SUMMARY.search(ln)), None)
    rec["output_tail"] = "\n".join(lines[-40:])
    if xml.exists():
        rec.update(parse_junit(xml))
    rec.save()
    if rec["returncode"] is None:
        raise RuntimeError(f"pytest killed at the stage's budget ({timeout:.0f} s); the output tail is in the record")
    if rec["returncode"] not in (0, 5):  # 5: nothing collected (e.g. every test deselected)
        raise RuntimeError(f"pytest exit code {rec['returncode']}: {rec.get('summary')}")


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failing tests (name, first line of the message) of a pytest junit file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
    failed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is not None:
                msg = (el.get("message") or el.text or "").strip().splitlines()
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                               "message": (msg[0] if msg else "")[:300]})
    if counts:
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"counts": counts, "failed": failed[:50], "num_failed_listed": len(failed)}


def stage_tests_triton(ctx: Ctx, rec: Record) -> None:
    present = [f for f in TRITON_TEST_FILES if (REPO / f).exists()]
    rec["missing_files"] = [f for f in TRITON_TEST_FILES if f not in present]
    if not present:
        raise RuntimeError(f"none of {TRITON_TEST_FILES} exists")
    run_pytest(ctx, rec, present, "triton")


def stage_tests_gpu(ctx: Ctx, rec: Record) -> None:
    """Every `gpu`-marked test outside the Triton files (those ran whole in tests_triton). Only the
    files that mention the marker are collected: the rest of the suite needs packages (the server's)
    that the device may not have, and a collection error would stop the run."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if str(p.relative_to(REPO)) not in TRITON_TEST_FILES and "mark.gpu" in p.read_text(errors="replace"))
    rec["files"] = files
    if not files:
        rec["summary"] = "no gpu-marked test outside the Triton files"
        return
    run_pytest(ctx, rec, ["-m", "gpu", *files], "gpu")
    if ctx.device != "cuda":
        rec["note"] = "no CUDA here: pytest skips every gpu-marked test (tests/conftest.py)"


def hf_load(path: Path, dtype: str, device: str):
    import torch
    import transformers as tf
    from transformers import AutoModelForCausalLM

    kw = {"dtype": _torch_dtype(dtype)} if int(tf.__version__.split(".")[0]) >= 5 else {"torch_dtype": _torch_dtype(dtype)}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kw).to(device).eval()
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    pad = gen.pad_token_id if gen.pad_token_id is not None else model.config.pad_token_id
    if pad is None:
        pad = min(eos_ids) if eos_ids else 0
    torch.set_grad_enabled(False)
    return model, eos_ids, int(pad)


def hf_generate(model, prompts: Sequence[Sequence[int]], new_tokens: int, pad: int, device: str,
                min_new: int | None = None) -> list[list[int]]:
    """One batched greedy `generate`, left-padded: the new tokens of each row."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.tensor(list(p))
        mask[j, width - len(p):] = 1
    kw = {"min_new_tokens": min_new} if min_new else {}
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad, **kw)
    _sync(device)
    return out[:, width:].tolist()


def stage_parity(ctx: Ctx, rec: Record, dtype: str) -> None:
    """Greedy tokens of transformers and pagedllm on the same weights, in `dtype`, on the device."""
    import torch

    path, kind, what = parity_model(ctx)
    prompts, prompt_kind = parity_prompts(ctx, path, kind)
    n_new = ctx.sizes.parity_new_tokens
    rec.update(model=what, weights=kind, dtype=dtype, prompts=len(prompts), prompt_kind=prompt_kind,
               new_tokens=n_new, float32_matmul_precision=torch.get_float32_matmul_precision(),
               expectation="equal tokens" if dtype == "float32" else "divergence expected (bf16 rounding)")
    rec.save()
    with rec.step("transformers") as sub:
        t0 = time.perf_counter()
        model, eos_ids, pad = hf_load(path, dtype, ctx.device)
        hf_tokens = [cut_at_eos(t, eos_ids) for t in hf_generate(model, prompts, n_new, pad, ctx.device)]
        sub["generate_s"] = round(time.perf_counter() - t0, 2)
        sub["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        del model
        _free(ctx.device)
    if "error" in rec["transformers"]:
        return
    with rec.step("pagedllm") as sub:
        from pagedllm import SamplingParams

        llm = make_llm(ctx, path, dtype=dtype, max_model_len=1024, max_num_seqs=max(8, len(prompts)),
                       gpu_memory_utilization=0.3)
        sub["engine"] = engine_figures(llm)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=n_new), use_tqdm=False)
        sub["generate_s"] = round(time.perf_counter() - t0, 2)
        ours = [cut_at_eos(o.outputs[0].token_ids, eos_ids) for o in outs]
        divs = [first_divergence(a, b) for a, b in zip(ours, hf_tokens)]
        rec["summary"] = divergence_summary(divs)
        rec["first_prompt_tokens"] = {"pagedllm": ours[0][:16], "transformers": hf_tokens[0][:16]}
        if (graphs := graph_figures(llm)) is not None:
            sub["cuda_graphs_after"] = graphs


def stage_throughput_pagedllm(ctx: Ctx, rec: Record, eager: bool) -> None:
    """One engine (the defaults but enforce_eager; gpu_memory_utilization 0.9, so its start-up
    figures are the 0.9 row of stage 5): steady decode at batch 1 and 64 first (stage 4), then
    the three workloads (stage 3)."""
    path = ctx.ensure_model("bench")
    rec.update(model="random TinyLlama-1.1B config" if ctx.sizes.mode == "full" else "random tiny config",
               dtype=ctx.sizes.bench_dtype, enforce_eager=eager, gpu_memory_utilization=0.9)
    rec["before"] = cuda_memory(ctx.device)
    t0 = time.perf_counter()
    llm = make_llm(ctx, path, dtype=ctx.sizes.bench_dtype, enforce_eager=eager, max_model_len=2048,
                   gpu_memory_utilization=0.9)
    rec["engine"] = engine_figures(llm)
    rec["engine"]["construct_s"] = round(time.perf_counter() - t0, 2)
    rec["after_startup"] = cuda_memory(ctx.device)
    rec.save()
    with rec.step("decode") as sub:
        measure_decode(ctx, llm, sub)
    with rec.step("warmup") as sub:  # the kernels' first compiles (Triton JIT) stay out of the timings
        from benchmarks.workloads import BenchRequest

        rng = random.Random(7)
        vocab = int(ctx.sizes.bench_config["vocab_size"])
        warm = [BenchRequest([rng.randrange(100, vocab) for _ in range(rng.randint(8, 200))], 8) for _ in range(16)]
        sub.update(drive(llm, warm, max(5.0, ctx.left() / 4), "warm"))
    limit = _time_shares(ctx, {"seed20": 1.0, "burst200": 1.0, "sharegpt1000": 3.0})
    for name in WORKLOAD_NAMES:
        with rec.step(name) as sub:
            reqs = bench_requests(ctx, name)
            llm.reset_prefix_cache()  # every run starts cold
            before = (graph_figures(llm) or {}).get("steps_run")
            sub.update(drive(llm, reqs, limit(name), name))
            after = (graph_figures(llm) or {}).get("steps_run")
            if before is not None and after is not None:
                sub["graph_steps"] = after - before


def measure_decode(ctx: Ctx, llm, rec: dict[str, Any]) -> None:
    """Steady decode: B sequences (128-token prompts) all decoding, 5 steps more, then
    `decode_steps` timed engine steps (a step returns once its tokens are on the host, so its time
    is the whole step), vs the roofline of reading every weight once from HBM."""
    from pagedllm import SamplingParams

    eng = llm.llm_engine
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    eng_fig = engine_figures(llm)
    kv_per_token = eng_fig["bytes_per_block"] // eng_fig["block_size"]
    roofline_ms = weight_bytes / HBM_BYTES_PER_S * 1e3
    rec.update(weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token, hbm_bytes_per_s=HBM_BYTES_PER_S,
               roofline_ms=round(roofline_ms, 5),
               roofline_note="all parameter bytes (the input embedding included) read once per step at 4.3 TB/s")
    vocab = int(ctx.sizes.bench_config["vocab_size"])
    rng = random.Random(11)
    for batch in ctx.sizes.decode_batches:
        sub: dict[str, Any] = rec.setdefault(f"batch_{batch}", {})
        ids = [f"dec{batch}-{i}" for i in range(batch)]
        try:
            for rid in ids:
                eng.add_request(rid, {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(128)]},
                                SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True))
            started: set[str] = set()
            for _ in range(1000):  # prefill (chunked) until every sequence decodes
                for out in eng.step():
                    if out.outputs[0].token_ids:
                        started.add(out.request_id)
                if len(started) == batch:
                    break
            else:
                raise RuntimeError(f"only {len(started)} of {batch} sequences decoding after 1000 steps")
            for _ in range(5):
                eng.step()
            before = (graph_figures(llm) or {}).get("steps_run")
            times, widths = [], []
            for _ in range(ctx.sizes.decode_steps):
                t = time.perf_counter()
                outs = eng.step()
                times.append(time.perf_counter() - t)
                widths.append(len(outs))
            after = (graph_figures(llm) or {}).get("steps_run")
        finally:
            eng.abort_request(ids)
        med = statistics.median(times) * 1e3
        mean_ctx = 128 + 6 + ctx.sizes.decode_steps // 2
        sub.update(steps=len(times), median_ms=round(med, 3), p10_ms=round(percentile(times, 0.1) * 1e3, 3),
                   p90_ms=round(percentile(times, 0.9) * 1e3, 3), rows_per_step=sorted(set(widths)),
                   ratio_to_roofline=round(med / roofline_ms, 2), tokens_per_s=round(batch / (med / 1e3), 1),
                   mean_context=mean_ctx, kv_bytes_per_step=batch * mean_ctx * kv_per_token)
        if before is not None and after is not None:
            sub["graph_steps"] = after - before


def stage_throughput_hf(ctx: Ctx, rec: Record) -> None:
    """transformers `generate`, batches of `hf_batch` in the workload's order, left-padded, each
    batch to its longest max_tokens (min_new_tokens = max_new_tokens: EOS ignored, as pagedllm's
    ignore_eos); only each request's own max_tokens count. Batches run while the time lasts: a
    workload cut short says on how many requests it ran."""
    path = ctx.ensure_model("bench")
    bs = ctx.sizes.hf_batch
    model, _, pad = hf_load(path, ctx.sizes.bench_dtype, ctx.device)
    rec.update(model="random TinyLlama-1.1B config" if ctx.sizes.mode == "full" else "random tiny config",
               dtype=ctx.sizes.bench_dtype, batch_size=bs,
               attn_implementation=getattr(model.config, "_attn_implementation", None))
    with rec.step("warmup"):
        hf_generate(model, [[5] * 16, [6] * 24], 8, pad, ctx.device, min_new=8)
    limit = _time_shares(ctx, {"seed20": 1.0, "burst200": 1.0, "sharegpt1000": 2.0})
    rate = StepRate()
    for name in WORKLOAD_NAMES:
        with rec.step(name) as sub:
            reqs = bench_requests(ctx, name)

            def generate(batch: list) -> None:
                new = max(r.max_tokens for r in batch)
                hf_generate(model, [r.prompt_token_ids for r in batch], new, pad, ctx.device, min_new=new)

            sub.update(run_batches(generate, reqs, bs, limit(name), ctx.left() - 3, rate))


@dataclass
class StepRate:
    """Seconds per generated step of the batches so far (the estimate of the next batch's time)."""

    seconds: float = 0.0
    steps: int = 0

    def estimate(self, steps: int) -> float | None:
        return self.seconds / self.steps * steps if self.steps else None


def run_batches(generate: Callable[[list], None], reqs: Sequence, batch_size: int, budget_s: float,
                hard_left_s: float, rate: StepRate) -> dict[str, Any]:
    """`generate` on batches of `reqs` in order, while the next batch's estimated time (its
    longest max_tokens at the step rate so far) fits in `budget_s`; the first batch of a workload
    runs if it fits in what the stage has left (`hard_left_s`). The rate counts each request's own
    max_tokens over the batches that ran."""
    t0 = time.perf_counter()
    done: list = []
    batch_s: list[float] = []
    for i in range(0, len(reqs), batch_size):
        batch = list(reqs[i:i + batch_size])
        steps = max(r.max_tokens for r in batch)
        est = rate.estimate(steps)
        spent = time.perf_counter() - t0
        if est is not None and spent + est > (budget_s if done else hard_left_s):
            break
        tb = time.perf_counter()
        generate(batch)
        batch_s.append(time.perf_counter() - tb)
        rate.seconds += batch_s[-1]
        rate.steps += steps
        done.extend(batch)
    elapsed = time.perf_counter() - t0
    useful = sum(r.max_tokens for r in done)
    return {"requests": len(reqs), "ran_requests": len(done), "complete": len(done) == len(reqs),
            "elapsed_s": round(elapsed, 3), "output_tokens": useful,
            "output_tokens_per_s": round(useful / elapsed, 1) if done and elapsed > 0 else None,
            "batch_seconds": [round(b, 2) for b in batch_s]}


def stage_kv_blocks(ctx: Ctx, rec: Record, util: float) -> None:
    """The engine at `util` with the defaults (CUDA graphs on) in a process of its own: its blocks,
    the memory profile it sized them by, the device's memory in use after start-up."""
    path = ctx.ensure_model("bench")
    rec.update(gpu_memory_utilization=util, model_dtype=ctx.sizes.bench_dtype)
    rec["before"] = cuda_memory(ctx.device)
    llm = make_llm(ctx, path, dtype=ctx.sizes.bench_dtype, gpu_memory_utilization=util, max_model_len=2048)
    rec["engine"] = engine_figures(llm)
    rec["after_startup"] = cuda_memory(ctx.device)
    if ctx.device != "cuda":
        rec["note"] = "CPU: gpu_memory_utilization has no effect here; kv_cache_space (0.25 GiB) sizes the pool"
    rec.save()
    with rec.step("one_request") as sub:  # the pool works: a short generation after sizing
        from pagedllm import SamplingParams

        out = llm.generate({"prompt_token_ids": [100 + i for i in range(32)]},
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        sub["tokens"] = len(out[0].outputs[0].token_ids)


def _expect_value_error(sub: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """Run `fn`; record the error it raised (the engine should raise a ValueError that says what to do)."""
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 (any other type is a finding, recorded as such)
        sub.update(raised=type(e).__name__, message=str(e)[:2000], ok=isinstance(e, ValueError))
        return None
    sub.update(raised=None, ok=False)
    return result


def stage_oom(ctx: Ctx, rec: Record) -> None:
    """The errors a user sees when the memory does not fit (CPU: kv_cache_space plays the role)."""
    bench = ctx.ensure_model("bench")
    gpu = ctx.device == "cuda"
    with rec.step("utilization_out_of_range") as sub:
        sub["knobs"] = {"gpu_memory_utilization": 1.5}
        _expect_value_error(sub, lambda: make_llm(ctx, bench, dtype=ctx.sizes.bench_dtype, gpu_memory_utilization=1.5))
    _free(ctx.device)
    with rec.step("too_small_for_weights") as sub:
        knobs = {"gpu_memory_utilization": 0.005} if gpu else {"kv_cache_space": 1e-6}
        sub["knobs"] = knobs
        if not gpu:
            sub["note"] = "CPU analog: the weights are not in the CPU budget; a kv_cache_space holding no block"
        _expect_value_error(sub, lambda: make_llm(ctx, bench, dtype=ctx.sizes.bench_dtype, enforce_eager=True,
                                                  max_model_len=2048, **knobs))
        sub["memory_after"] = cuda_memory(ctx.device)
    _free(ctx.device)
    with rec.step("max_model_len_too_large") as sub:
        long = ctx.ensure_model("bench_long")
        knobs = {"gpu_memory_utilization": 0.1} if gpu else {"kv_cache_space": 0.001}
        sub["knobs"] = {**knobs, "max_model_len": LONG_CONTEXT}
        llm = _expect_value_error(sub, lambda: make_llm(ctx, long, dtype=ctx.sizes.bench_dtype, enforce_eager=True,
                                                        max_model_len=LONG_CONTEXT, **knobs))
        if llm is not None:  # started: the pool is smaller than one request of max_model_len
            eng = llm.llm_engine
            sub["started_with"] = {"num_blocks": eng.num_blocks, "kv_tokens": eng.num_blocks * eng.block_size}
            from pagedllm import SamplingParams

            req: dict[str, Any] = {}
            _expect_value_error(req, lambda: eng.add_request(
                "long", {"prompt_token_ids": [100]}, SamplingParams(max_tokens=LONG_CONTEXT - 1, ignore_eos=True)))
            sub["request_of_max_model_len"] = req
            del llm, eng


STAGE_FUNCS: dict[str, Callable[[Ctx, Record], None]] = {
    "models": stage_models,
    "tests_triton": stage_tests_triton,
    "tests_gpu": stage_tests_gpu,
    "parity_bfloat16": lambda c, r: stage_parity(c, r, "bfloat16"),
    "parity_float32": lambda c, r: stage_parity(c, r, "float32"),
    "throughput_eager": lambda c, r: stage_throughput_pagedllm(c, r, eager=True),
    "throughput_graphs": lambda c, r: stage_throughput_pagedllm(c, r, eager=False),
    "throughput_hf": stage_throughput_hf,
    "kv_blocks_0.5": lambda c, r: stage_kv_blocks(c, r, 0.5),
    "oom": stage_oom,
}


def run_child(stage: str, sizes: Sizes, work: Path, budget: float) -> int:
    """One stage in this process: its record goes to work/results/<stage>.json."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rec = Record(work / "results" / f"{stage}.json")
    ctx = Ctx(sizes, work, time.perf_counter() + budget)
    rec.update(stage=stage, status="running", pid=os.getpid())
    rec.save()
    t0 = time.perf_counter()
    try:
        if sizes.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("the full run needs CUDA and torch sees no GPU (use --smoke on a CPU)")
        STAGE_FUNCS[stage](ctx, rec)
        rec["status"] = "partial" if rec.get("errors") else "ok"
    except Exception:  # noqa: BLE001
        rec["status"] = "failed"
        rec["traceback"] = traceback.format_exc(limit=15)
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    rec.save()
    return 0


# ---------------------------------------------------------------------------- the parent


def _kill_group(proc: subprocess.Popen) -> None:
    """End a child and everything it started (it leads its own process group; not a session of its
    own, so nothing outlives the device run's command)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions, the commit and the GPU as nvidia-smi names it (this process never initialises CUDA)."""
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                           "packages": {p: _version(p) for p in ("torch", "triton", "transformers", "tokenizers",
                                                                 "safetensors", "msgspec", "pytest")},
                           "tree_hash": tree_hash()}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            env["commit"] = commit.stdout.strip()
            env["dirty_files"] = len(dirty.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        pass
    if "commit" not in env:
        env["commit"] = os.environ.get("PAGEDLLM_COMMIT") or "unknown (no .git here: pass PAGEDLLM_COMMIT=<hash>)"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()[:300]
    return env


def run_parent(sizes: Sizes, out: Path, deadline_s: float, only: list[str] | None, keep_work: bool) -> dict[str, Any]:
    t_start = time.perf_counter()
    deadline = t_start + deadline_s
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve().is_relative_to(REPO) and not (out / ".gitignore").exists():
        (out / ".gitignore").write_text("*\n")  # an output folder in the checkout: never travels nor committed
    work = Path(tempfile.mkdtemp(prefix="pagedllm-gpu-check-"))
    (work / "results").mkdir()
    log_path = out / "gpu_check.log"
    current: list[subprocess.Popen | None] = [None]

    def on_term(signum: int, _frame: Any) -> None:
        """Killed from outside (the shell's backstop timeout): end the running stage, keep the files."""
        if current[0] is not None:
            _kill_group(current[0])
        report["killed_by_signal"] = signum
        write_outputs(report, out)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    report: dict[str, Any] = {"mode": sizes.mode, "device": sizes.device, "deadline_s": deadline_s,
                              "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                              "env": environment(), "stages": {}}
    specs = [s for s in sizes.stages if only is None or s.name in only or s.name == "models"]
    with open(log_path, "w") as log:
        for i, spec in enumerate(specs):
            now = time.perf_counter()
            reserve = sum(s.reserve_s for s in specs[i + 1:])
            budget = min(spec.cap_s, deadline - now - reserve, deadline - now - 2)
            if budget < sizes.min_start_s:
                report["stages"][spec.name] = {"status": "skipped", "note": (
                    f"{deadline - now:.0f} s left before the deadline, {reserve:.0f} s reserved for later stages")}
                print(f"[gpu_check] {spec.name}: skipped (deadline)", flush=True)
                continue
            print(f"[gpu_check] {spec.name}: budget {budget:.0f} s", flush=True)
            log.write(f"\n===== {spec.name} (budget {budget:.0f} s) =====\n")
            log.flush()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", spec.name, "--work", str(work),
                   "--budget", f"{budget:.1f}"] + (["--smoke"] if sizes.mode == "smoke" else [])
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, process_group=0)
            current[0] = proc
            timed_out = False
            try:
                rc = proc.wait(timeout=budget + 5)  # the child watches its own budget too
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                rc = proc.returncode
            res_path = work / "results" / f"{spec.name}.json"
            try:
                res = json.loads(res_path.read_text())
            except (OSError, ValueError):
                res = {"status": "failed", "error": f"the stage wrote no record (exit code {rc})"}
            if timed_out:
                res["status"] = "timeout"
                res["note"] = f"killed at its budget of {budget:.0f} s; what it recorded before is kept"
            elif res.get("status") == "running":
                res["status"] = "failed"
                res["error"] = f"the stage process ended (exit code {rc}) before finishing its record"
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            res["budget_s"] = round(budget, 1)
            report["stages"][spec.name] = res
            current[0] = None
            for name in ("triton", "gpu"):  # the whole pytest output comes back too
                src = work / f"pytest_{name}.txt"
                if spec.name == f"tests_{name}" and src.exists():
                    (out / src.name).write_bytes(src.read_bytes()[-(8 << 20):])
            print(f"[gpu_check] {spec.name}: {res['status']} in {res['wall_s']} s", flush=True)
            report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            write_outputs(report, out)
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write_outputs(report, out)
    cap_file(log_path, 12 << 20)  # the device returns files of at most 16 MiB
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    else:
        report["work_dir"] = str(work)
    return report


def cap_file(path: Path, limit: int) -> None:
    """Keep a too-long log's first and last parts (a file over the device's limit would not come back)."""
    if not path.exists() or path.stat().st_size <= limit:
        return
    data = path.read_bytes()
    head, tail = data[: limit // 5], data[-(limit * 3 // 4):]
    path.write_bytes(head + f"\n[... {len(data) - len(head) - len(tail)} bytes left out ...]\n".encode() + tail)


def write_outputs(report: dict[str, Any], out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=_json_default))
    (out / "gpu_check.md").write_text(render_markdown(report))


# ---------------------------------------------------------------------------- the table


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _ratio(a: Any, b: Any) -> str:
    try:
        return f"{a / b:.2f}x" if a and b else "–"
    except TypeError:
        return "–"


def _stage_error(st: dict[str, Any]) -> str:
    """The last line of a stage's traceback / error (the JSON has the whole)."""
    for key in ("traceback", "error"):
        if st.get(key):
            return str(st[key]).strip().splitlines()[-1][:240]
    errs = [f"{k}: {str(st[k]['error']).strip().splitlines()[-1][:160]}" for k in st.get("errors", [])
            if isinstance(st.get(k), dict) and st[k].get("error")]
    return "; ".join(errs)[:400]


def render_markdown(report: dict[str, Any]) -> str:
    """The table of the run; each section renders on its own (a broken one says so, the rest stays)."""
    parts = []
    for section in (_md_header, _md_stages, _md_tests, _md_parity, _md_throughput, _md_decode, _md_memory):
        try:
            parts.append(section(report))
        except Exception as e:  # noqa: BLE001 (a table with a hole beats no table)
            parts.append(f"\n({section.__name__} could not render: {type(e).__name__}: {e})\n")
    return "\n".join(p for p in parts if p) + "\n"


def _md_header(r: dict[str, Any]) -> str:
    env = r.get("env", {})
    pk = env.get("packages", {})
    gpu = r.get("stages", {}).get("models", {}).get("gpu") or {}
    lines = [f"# pagedllm GPU check ({r.get('mode')} run, {r.get('device')})", "",
             f"- started {r.get('started_utc')}, {r.get('elapsed_s')} s of a {r.get('deadline_s')} s deadline",
             f"- GPU: {gpu.get('name') or env.get('nvidia_smi') or 'none'}"
             + (f", {gpu.get('total_memory_gib')} GiB, sm {gpu.get('capability')}" if gpu else ""),
             f"- torch {pk.get('torch')} (CUDA {r.get('stages', {}).get('models', {}).get('torch_cuda')}), "
             f"triton {pk.get('triton')}, transformers {pk.get('transformers')}, python {env.get('python')}",
             f"- commit {env.get('commit')}" + (f" (+{env['dirty_files']} modified files)" if env.get("dirty_files") else "")
             + f", tree hash {env.get('tree_hash')}"]
    return "\n".join(lines)


def _md_stages(r: dict[str, Any]) -> str:
    rows = ["", "## Stages", "", "| stage | status | s | budget s | note |", "| --- | --- | --- | --- | --- |"]
    for name, st in r.get("stages", {}).items():
        note = st.get("note") or _stage_error(st)
        rows.append(f"| {name} | {st.get('status')} | {_fmt(st.get('wall_s'))} | {_fmt(st.get('budget_s'), 0)} | "
                    f"{str(note).replace('|', '/')} |")
    return "\n".join(rows)


def _md_tests(r: dict[str, Any]) -> str:
    rows = ["", "## 1. Kernel tests on the device", "", "| run | passed | failed | errors | skipped | pytest summary |",
            "| --- | --- | --- | --- | --- | --- |"]
    fails = []
    for name in ("tests_triton", "tests_gpu"):
        st = r.get("stages", {}).get(name)
        if not st:
            continue
        c = st.get("counts") or {}
        rows.append(f"| {name} | {_fmt(c.get('passed'))} | {_fmt(c.get('failures'))} | {_fmt(c.get('errors'))} | "
                    f"{_fmt(c.get('skipped'))} | {st.get('summary') or st.get('status')} |")
        if st.get("missing_files"):
            fails.append(f"- {name}: missing {', '.join(st['missing_files'])}")
        for f in st.get("failed", [])[:10]:
            fails.append(f"- {f['test']}: {f['message'][:160]}")
    return "\n".join(rows + ([""] + fails if fails else []))


def _md_parity(r: dict[str, Any]) -> str:
    rows = ["", "## 2. Greedy parity vs transformers", "",
            "| dtype | weights | prompts | new tokens | equal | median first divergence | min | expectation |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    per = []
    for dtype in ("bfloat16", "float32"):
        st = r.get("stages", {}).get(f"parity_{dtype}")
        if not st:
            continue
        s = st.get("summary") or {}
        rows.append(f"| {dtype} | {st.get('model', '–')} | {_fmt(st.get('prompts'))} | {_fmt(st.get('new_tokens'))} | "
                    f"{_fmt(s.get('num_equal'))} / {_fmt(s.get('num_prompts'))} | {_fmt(s.get('median_first_divergence'))}"
                    f" | {_fmt(s.get('min_first_divergence'))} | {st.get('expectation', '–')} |")
        if s.get("per_prompt"):
            per.append(f"- {dtype} first divergence per prompt: "
                       + " ".join("=" if d == "equal" else str(d) for d in s["per_prompt"]))
    return "\n".join(rows + ([""] + per + ["  (= : equal tokens)"] if per else []))


def _md_throughput(r: dict[str, Any]) -> str:
    st = r.get("stages", {})
    eager, graphs, hf = (st.get(k, {}) for k in ("throughput_eager", "throughput_graphs", "throughput_hf"))
    model = eager.get("model") or graphs.get("model") or hf.get("model") or "–"
    rows = ["", f"## 3. Throughput (output tokens/s; {model}, {eager.get('dtype') or hf.get('dtype') or '–'})", "",
            "| workload | requests | eager | CUDA graphs | transformers (batch "
            f"{hf.get('batch_size', '–')}) | graphs / eager | graphs / HF | eager / HF |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []

    def cell(res: dict[str, Any] | None, who: str, name: str) -> tuple[str, float | None]:
        if not res:
            return "–", None
        if res.get("error"):
            notes.append(f"- {who} {name}: {str(res['error']).strip().splitlines()[-1][:200]}")
            return "error", None
        v = res.get("output_tokens_per_s")
        if res.get("complete") is False:
            n = res.get("ran_requests", res.get("finished"))
            notes.append(f"- {who} {name}: ran on {n} of {res.get('requests')} requests (time budget); "
                         "its rate covers only those")
            return f"{_fmt(v)} ({n} req)", v
        return _fmt(v), v

    for name in WORKLOAD_NAMES:
        e, ev = cell(eager.get(name), "eager", name)
        g, gv = cell(graphs.get(name), "graphs", name)
        h, hv = cell(hf.get(name), "transformers", name)
        n = next((x.get(name, {}).get("requests") for x in (eager, graphs, hf) if x.get(name)), None)
        rows.append(f"| {name} | {_fmt(n)} | {e} | {g} | {h} | {_ratio(gv, ev)} | {_ratio(gv, hv)} | {_ratio(ev, hv)} |")
    if r.get("device") == "cpu":
        notes.append("- CPU: enforce_eager=False captures no CUDA graph (it runs eager too); the columns "
                     "exercise the code paths, they measure nothing of the GPU")
    for who, res in (("eager", eager), ("graphs", graphs)):
        eng = res.get("engine") or {}
        if eng.get("cuda_graphs"):
            cg = eng["cuda_graphs"]
            notes.append(f"- {who}: CUDA graphs captured in {_fmt(cg.get('capture_seconds'), 2)} s, pool "
                         f"{_fmt((cg.get('pool_bytes') or 0) / 2**20, 0)} MiB, sizes {cg.get('batch_sizes')}")
        if eng:
            notes.append(f"- {who} engine: {eng.get('num_blocks')} blocks, start-up {eng.get('startup_s')} s, "
                         f"attention backend {eng.get('attention_backend_resolved') or eng.get('attention_backend')}")
    return "\n".join(rows + ([""] + notes if notes else []))


def _md_decode(r: dict[str, Any]) -> str:
    rows = ["", "## 4. Steady decode step vs the HBM roofline (weight bytes / 4.3 TB/s)", "",
            "| mode | batch | median ms | p10 / p90 ms | roofline ms | ratio | tokens/s | graph steps |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    weight_bytes = None
    for mode in ("eager", "graphs"):
        st = (r.get("stages", {}).get(f"throughput_{mode}") or {}).get("decode")
        if not st:
            continue
        if st.get("error"):
            rows.append(f"| {mode} | – | error: {_stage_error({'error': st['error']})} | | | | | |")
        weight_bytes = weight_bytes or st.get("weight_bytes")
        for key in sorted((k for k in st if k.startswith("batch_")), key=lambda k: int(k.split("_")[1])):
            b = st[key]
            if "median_ms" not in b:
                continue
            rows.append(f"| {mode} | {key[6:]} | {_fmt(b.get('median_ms'), 3)} | {_fmt(b.get('p10_ms'), 2)} / "
                        f"{_fmt(b.get('p90_ms'), 2)} | {_fmt(st.get('roofline_ms'), 3)} | {_fmt(b.get('ratio_to_roofline'), 2)}x"
                        f" | {_fmt(b.get('tokens_per_s'))} | {_fmt(b.get('graph_steps'))} |")
    if weight_bytes:
        rows += ["", f"Weight bytes {weight_bytes / 1e9:.3f} GB (all parameters); ratio = median / roofline."]
    return "\n".join(rows)


def _md_memory(r: dict[str, Any]) -> str:
    st = r.get("stages", {})
    rows = ["", "## 5. KV cache sizing and the out-of-memory errors", "",
            "| gpu_memory_utilization | from | blocks | KV tokens | KV GiB | used after start-up | "
            "weights / activations / graphs / non-torch GiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for key in ("kv_blocks_0.5", "throughput_graphs"):
        s = st.get(key)
        if not s:
            continue
        eng = s.get("engine") or {}
        mp = eng.get("memory_profile_gib") or {}
        used = (s.get("after_startup") or {}).get("used_fraction")
        detail = (" / ".join(_fmt(mp.get(k), 2) for k in ("weights", "peak_activations", "cuda_graphs", "non_torch"))
                  if mp else (s.get("note") or _stage_error(s) or "–"))
        rows.append(f"| {s.get('gpu_memory_utilization', '–')} | {key} | {_fmt(eng.get('num_blocks'))} | "
                    f"{_fmt(eng.get('kv_tokens'))} | {_fmt(eng.get('kv_cache_gib'), 2)} | {_fmt(used, 3)} | "
                    f"{str(detail).replace('|', '/')} |")
    oom = st.get("oom") or {}
    rows += ["", "| case | knobs | raised | message |", "| --- | --- | --- | --- |"]
    for case in ("utilization_out_of_range", "too_small_for_weights", "max_model_len_too_large"):
        c = oom.get(case)
        if not c:
            continue
        if c.get("error"):
            rows.append(f"| {case} | {c.get('knobs')} | stage error | {_stage_error({'error': c['error']})} |")
            continue
        msg = (c.get("message") or "no error raised").replace("|", "/").replace("\n", " ")
        if c.get("raised") is None and c.get("request_of_max_model_len"):
            q = c["request_of_max_model_len"]
            msg += (f"; the engine started with {c.get('started_with')}; a request of max_model_len tokens: "
                    f"{q.get('raised')}: {(q.get('message') or 'accepted')[:300]}")
        rows.append(f"| {case} | {c.get('knobs')} | {c.get('raised') or 'nothing'} | {msg[:700]} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: every code path in minutes")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "gpu_check_out"))
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--only", default=None, help="comma-separated stages (models always runs)")
    ap.add_argument("--keep-work", action="store_true", help="keep the temp folder (models, pytest logs)")
    ap.add_argument("--tree-hash", action="store_true", help="print the tree hash the report records, and exit")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if args.tree_hash:
        print(tree_hash())
        return 0
    if args.stage:
        return run_child(args.stage, sizes, Path(args.work), args.budget)
    only = args.only.split(",") if args.only else None
    if only:
        unknown = sorted(set(only) - set(STAGE_FUNCS))
        if unknown:
            ap.error(f"unknown stages {unknown}; known: {list(STAGE_FUNCS)}")
    report = run_parent(sizes, Path(args.out), args.deadline or sizes.deadline_s, only, args.keep_work)
    bad = [n for n, s in report["stages"].items() if s.get("status") != "ok"]
    print(f"[gpu_check] wrote {Path(args.out) / 'gpu_check.json'} and gpu_check.md in {report['elapsed_s']} s; "
          f"not ok: {bad or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
