"""The calibration and held-out texts shipped with pagedllm (`pagedllm/data/`), and calibration
samples: token windows of a text.

Both texts were written for this project (varied English: narrative, technical prose, dialogue,
lists, letters, instructions); neither is copied from anywhere. The held-out text is never used
for calibration: it is what `benchmarks/perplexity.py` measures.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CALIBRATION = "calibration.txt"
HELDOUT = "heldout.txt"


def shipped_text(name: str) -> str:
    """The text of a file shipped in `pagedllm/data/` (CALIBRATION or HELDOUT)."""
    return resources.files("pagedllm.data").joinpath(name).read_text(encoding="utf-8")


def read_text(path: str | None) -> str:
    """A calibration text: the shipped one for None, else the file's contents."""
    if path is None:
        return shipped_text(CALIBRATION)
    text = Path(path).expanduser().read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"calibration file {path!r} is empty")
    return text


MAX_DEFAULT_SAMPLES = 128


def token_windows(token_ids: list[int], num_samples: int | None, seq_len: int) -> torch.Tensor:
    """`[num_samples, seq_len]` windows of `token_ids`: consecutive, non-overlapping and spread
    evenly over the text when it is long enough, else evenly spaced overlapping windows.
    `num_samples=None`: as many non-overlapping windows as the text holds, at most 128."""
    if num_samples is None:
        num_samples = max(1, min(MAX_DEFAULT_SAMPLES, len(token_ids) // seq_len))
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and {seq_len}")
    n = len(token_ids)
    if n < seq_len:
        raise ValueError(f"the calibration text has {n} tokens, fewer than one window of seq_len={seq_len}")
    ids = torch.tensor(token_ids, dtype=torch.int64)
    if num_samples * seq_len <= n:
        n_windows = n // seq_len
        picks = torch.linspace(0, n_windows - 1, num_samples).round().long()
        starts = picks * seq_len
    else:
        logger.warning("calibration text has %d tokens < %d x %d: the windows overlap", n, num_samples, seq_len)
        starts = torch.linspace(0, n - seq_len, num_samples).round().long()
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def calibration_samples(tokenizer, text: str, num_samples: int | None, seq_len: int) -> torch.Tensor:
    """Token windows `[num_samples, seq_len]` of `text` (no special tokens added)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return token_windows(ids, num_samples, seq_len)
