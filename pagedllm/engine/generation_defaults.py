"""The model's generation_config.json sampling defaults, applied as vLLM's `--generation-config`.

vLLM reads `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens`
from the model's generation_config.json ("auto", the default) and uses them for every request
field the request does not set; "vllm" ignores the file (vLLM's own defaults), and a folder
path reads that folder's generation_config.json instead. `max_new_tokens` becomes a cap on
`max_tokens` (vLLM takes the smallest of the request's, the default and this one).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams name
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def check_generation_config(value: str) -> None:
    """'auto', 'vllm' or an existing folder (a precise start-up error otherwise)."""
    if value in ("auto", "vllm"):
        return
    if not Path(value).is_dir():
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder holding a "
            f"generation_config.json, got {value!r} (not a folder)."
        )


def load_generation_defaults(setting: str, model_path: str | None, is_gguf: bool) -> dict[str, Any]:
    """The sampling defaults that `setting` asks for (empty: vLLM's built-in defaults).

    A .gguf file has no generation_config.json beside it; "auto" then gives no defaults."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if is_gguf or model_path is None:
            return {}
        folder = Path(model_path)
    else:
        folder = Path(setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"Could not read {path}: {exc}") from exc
    defaults = {ours: raw[key] for key, ours in _KEYS.items() if raw.get(key) is not None}
    if defaults:
        logger.info("Default sampling parameters from %s: %s (--generation-config vllm turns "
                    "them off)", path, defaults)
    return defaults
