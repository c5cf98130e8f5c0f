"""Every environment variable pagedllm reads, declared once: its name, type, default and one line
of documentation (vLLM's `envs.py` pattern).

Read a knob as an attribute, `envs.PAGEDLLM_CACHE_DIR`: each read parses the environment as it is
now (tests and benchmarks change it at run time), and a value that does not parse is refused with
a `ValueError` naming the variable. `pagedllm --help-env` prints the table, and
docs/environment.md is generated from it (`python -m pagedllm.envs > docs/environment.md`; a test
keeps the two equal). No other module reads `os.environ` for these names (a test checks that too).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str], Any]  # the raw string -> the value (ValueError: refused)
    default: Any  # the value when unset
    doc: str
    kind: str  # the type, as the table shows it
    shown_default: str = ""  # the default as the table shows it ("": `default` itself)


def _flag(raw: str) -> bool:
    """pagedllm's switches: unset or "0" or "" is off, anything else on."""
    return raw.strip() not in ("", "0")


def _truthy(raw: str) -> bool:
    """Other projects' switches (Triton, vLLM): 1 / true / on / yes."""
    return raw.strip().lower() in ("1", "true", "on", "yes")


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        return math.nan


def _seconds(raw: str) -> float:
    value = _number(raw)
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a number of seconds >= 0")
    return value


def _positive(raw: str) -> float:
    value = _number(raw)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive number")
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip() or allowed[0]
        if value not in allowed:
            raise ValueError(f"must be one of {list(allowed)}")
        return value
    return parse


def _text(raw: str) -> str:
    return raw.strip()


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


_KNOBS = (
    # ---- files and caches
    Knob("PAGEDLLM_CACHE_DIR", _path, Path.home() / ".cache" / "pagedllm",
         "the folder for the default model, converted tokenizers and configs, built kernels and kernel choices",
         "path", "~/.cache/pagedllm"),
    # ---- the C kernels (docs/cpu_kernels.md)
    Knob("PAGEDLLM_DISABLE_C_KERNELS", _flag, False,
         "1: run the plain-torch paths instead of the C kernels", "flag"),
    Knob("PAGEDLLM_KERNEL_BUILD_TIMEOUT", _positive, 120.0,
         "seconds each compiler run may take before the kernel stays off", "seconds"),
    Knob("PAGEDLLM_KERNEL_MARCH", _text, "",
         "force one instruction-set variant of the C kernels (avx512-vnni-bf16, avx2, portable, x86-64-v3, "
         "native, any -march value) instead of the one chosen from the CPU's features", "variant"),
    Knob("CC", _text, "", "the C compiler that builds the kernels (default: gcc, else cc)", "command"),
    Knob("PAGEDLLM_KERNEL_CHOICE", _choice("measure", "kernel", "torch"), "measure",
         "measure: per float32 projection shape and batch bucket keep the C kernel unless torch's op is clearly "
         "faster on a quiet machine; kernel: always the C kernels; torch: always torch's op (A/B runs)", "choice"),
    Knob("PAGEDLLM_KERNEL_CHOICE_BUDGET", _seconds, 1.0,
         "seconds a process may spend measuring kernel choices at start-up", "seconds"),
    Knob("PAGEDLLM_DECODE_STEP", _flag, True,
         "0: decode steps run the eager model instead of the C decode step (one C call a step; A/B runs, "
         "debugging)", "flag"),
    Knob("PAGEDLLM_BLOCK_WEIGHTS", _flag, True,
         "0: float weights that are exact 4-/8-bit block grids stay float32 panels (A/B runs; read at import)",
         "flag"),
    Knob("PAGEDLLM_GGUF_BLOCKS", _flag, True,
         "0: a GGUF file's matrices are widened to float32 at load instead of read in their blocks (A/B runs)",
         "flag"),
    Knob("TRITON_INTERPRET", _truthy, False,
         "Triton's own switch: 1 runs the Triton kernels in its interpreter (CPU tests of the GPU path)", "flag"),
    # ---- serving
    Knob("PAGEDLLM_API_KEY", _text, "", "the API key of `pagedllm serve` when --api-key is not given", "secret"),
    Knob("PAGEDLLM_ENGINE_IN_PROCESS", _flag, False,
         "1: the server's engine core runs in a thread of the API server process instead of its own process "
         "(debugging, comparisons)", "flag"),
    Knob("VLLM_ALLOW_RUNTIME_LORA_UPDATING", _truthy, False,
         "vLLM's switch, read as vLLM reads it: 1 allows /v1/load_lora_adapter and /v1/unload_lora_adapter",
         "flag"),
    Knob("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", _truthy, False,
         "the same as VLLM_ALLOW_RUNTIME_LORA_UPDATING", "flag"),
    # ---- tensor parallelism and Ray (docs/tensor_parallel.md, docs/data_parallel.md)
    Knob("PAGEDLLM_TP_TIMEOUT_S", _positive, 120.0,
         "seconds a tensor-parallel rank waits in a collective for the others (a hung peer)", "seconds"),
    Knob("PAGEDLLM_TP_START_TIMEOUT_S", _positive, 600.0,
         "seconds the tensor-parallel workers may take to start and load their shards", "seconds"),
    Knob("RAY_ADDRESS", _text, "", "Ray's own: the cluster to join (unset: a local Ray)", "address"),
    Knob("PAGEDLLM_RAY_CPUS_PER_RANK", _positive, 1.0, "CPUs each tensor-parallel Ray actor reserves", "number"),
    Knob("PAGEDLLM_RAY_PLACEMENT_STRATEGY", _choice("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"), "STRICT_PACK",
         "the Ray placement group strategy of one replica's tensor-parallel ranks", "choice"),
    Knob("PAGEDLLM_RAY_CPUS_PER_REPLICA", _positive, 1.0, "CPUs each data-parallel Ray replica's core reserves",
         "number"),
    Knob("PAGEDLLM_RAY_REPLICA_STRATEGY", _choice("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"), "PACK",
         "the Ray placement group strategy of the data-parallel replicas", "choice"),
)
KNOBS: dict[str, Knob] = {k.name: k for k in _KNOBS}


def read(name: str) -> Any:
    """The value of knob `name` now (its default when unset); ValueError if it does not parse."""
    knob = KNOBS[name]
    raw = os.environ.get(name)
    if raw is None:
        return knob.default
    try:
        return knob.parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name} {exc}, got {raw!r}") from None


def is_set(name: str) -> bool:
    """Whether knob `name` is set in the environment (a set value may still be its default)."""
    if name not in KNOBS:
        raise KeyError(name)
    return name in os.environ


def __getattr__(name: str) -> Any:
    if name in KNOBS:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def table_markdown() -> str:
    """docs/environment.md: every knob with its type, default and documentation."""
    lines = ["# Environment variables", "",
             "Every environment variable pagedllm reads (generated from `pagedllm/envs.py` by",
             "`python -m pagedllm.envs > docs/environment.md`; `pagedllm --help-env` prints the same).",
             "Command-line flags and `LLM(...)` arguments are the main knobs (README); these are for",
             "what has no flag: caches, kernels, A/B switches, distributed start-up.", "",
             "| variable | type | default | what |", "| --- | --- | --- | --- |"]
    for k in _KNOBS:
        default = k.shown_default or ("unset" if k.default in ("", None) else str(k.default).lower()
                                      if isinstance(k.default, bool) else str(k.default))
        lines.append(f"| `{k.name}` | {k.kind} | {default} | {k.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table_markdown(), end="")
