"""`speculative_config`: vLLM's keys and defaults, validated once; what pagedllm does not
build is refused by name.

`LLM(..., speculative_config={...})` and `pagedllm serve --speculative-config '{...}'` take
the same dict as vLLM's. Methods built: "ngram" (prompt lookup), "suffix" and "draft_model"
(a small model with the target's tokenizer; `{"model": path}` alone means it, as in vLLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
# vLLM's other methods: their proposers need trained heads or hidden states pagedllm's models
# do not expose.
REFUSED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "mimo_mtp",
                   "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp", "longcat_flash_mtp", "ngram_gpu",
                   "pard", "dflash")
# vLLM's keys that pagedllm takes as they are; any other key is refused by name.
_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "draft_tensor_parallel_size", "quantization", "max_model_len",
         "revision", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
         "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model (method "draft_model")
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    # Speculation is off for a step whose running requests reach this many (vLLM's name).
    disable_by_batch_size: int | None = None
    draft_tensor_parallel_size: int = 1
    quantization: str | None = None
    max_model_len: int | None = None
    revision: str | None = None
    # Suffix decoding (vLLM's names and defaults).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_value(cls, value: Any) -> "SpeculativeConfig | None":
        """From a dict, a JSON string (the CLI's form), a SpeculativeConfig, or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}.")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config key(s) {unknown} are not supported by pagedllm; "
                             f"supported: {list(_KEYS)}.")
        return cls._build(dict(value))

    @classmethod
    def _build(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        method, model = d.get("method"), d.get("model")
        if method is None:
            if model in ("ngram", "[ngram]"):  # vLLM's older spelling
                method, model = "ngram", None
            elif model is not None:
                method = "draft_model"
            else:
                raise ValueError("speculative_config needs 'method' (one of "
                                 f"{list(METHODS)}) or a draft 'model'.")
        if method == "[ngram]":
            method = "ngram"
        if method in REFUSED_METHODS:
            raise ValueError(f"speculative method {method!r} is not supported by pagedllm (it needs a "
                             f"trained head or the target's hidden states); use one of {list(METHODS)}.")
        if method not in METHODS:
            raise ValueError(f"Unknown speculative method {method!r}; supported: {list(METHODS)}.")
        if method == "draft_model" and not model:
            raise ValueError("speculative method 'draft_model' needs 'model' (a folder or Hub id with the "
                             "target's tokenizer).")
        if method != "draft_model" and model is not None:
            raise ValueError(f"speculative_config 'model' is for method 'draft_model', not {method!r}.")
        if method == "suffix":
            _check_suffix_knobs(d)
        k = d.get("num_speculative_tokens")
        if k is None and method == "suffix":
            # vLLM: suffix decoding sizes each draft itself; k is only a cap (the tree depth)
            k = min(d.get("suffix_decoding_max_tree_depth", 24), 64)
        if k is None:
            raise ValueError("speculative_config needs 'num_speculative_tokens'.")
        _positive_int("num_speculative_tokens", k, upper=64)
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":
            if lo is None and hi is None:
                lo = hi = 5  # vLLM's defaults
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            _positive_int("prompt_lookup_min", lo)
            _positive_int("prompt_lookup_max", hi)
            if lo > hi:
                raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}.")
        elif lo is not None or hi is not None:
            raise ValueError(f"prompt_lookup_min / prompt_lookup_max are for method 'ngram', not {method!r}.")
        dbs = d.get("disable_by_batch_size")
        if dbs is not None:
            _positive_int("disable_by_batch_size", dbs)
        tp = d.get("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(f"draft_tensor_parallel_size={tp!r} is not supported: the proposer runs on rank 0 "
                             "(draft_tensor_parallel_size=1).")
        if method != "draft_model":
            for key in ("quantization", "max_model_len", "revision"):
                if key in d:
                    raise ValueError(f"speculative_config {key!r} is for method 'draft_model', not {method!r}.")
        if method != "suffix":
            for key in _KEYS:
                if key.startswith("suffix_decoding_") and key in d:
                    raise ValueError(f"speculative_config {key!r} is for method 'suffix', not {method!r}.")
        out = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        out.update(method=method, model=model, num_speculative_tokens=k)
        if method == "ngram":
            out.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
        return cls(**out)


def _check_suffix_knobs(d: dict[str, Any]) -> None:
    """vLLM's ranges: tree depth >= 1, cached requests >= 0 (0: no global tree), spec factor
    >= 0, min token probability in [0, 1]."""
    if "suffix_decoding_max_tree_depth" in d:
        _positive_int("suffix_decoding_max_tree_depth", d["suffix_decoding_max_tree_depth"])
    n = d.get("suffix_decoding_max_cached_requests", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"speculative_config suffix_decoding_max_cached_requests must be an integer >= 0, "
                         f"got {n!r}.")
    for name, upper in (("suffix_decoding_max_spec_factor", None), ("suffix_decoding_min_token_prob", 1.0)):
        v = d.get(name, 0.0)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0
                or (upper is not None and v > upper) or v == float("inf")):
            rng = "in [0, 1]" if upper is not None else "a finite number >= 0"
            raise ValueError(f"speculative_config {name} must be {rng}, got {v!r}.")


def _positive_int(name: str, value: Any, upper: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}.")
    if upper is not None and value > upper:
        raise ValueError(f"speculative_config {name}={value} is more than {upper}.")
