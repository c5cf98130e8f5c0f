"""The default model as transformers sees it, made once per test process: transformers' GGUF
converters read the whole file in Python (the tokenizer's 49k merges, every tensor dequantized
with numpy), seconds each time, and a dozen fixtures need them."""

from __future__ import annotations

import functools
import os


@functools.cache
def hf_tokenizer(gguf_path: str):
    """transformers' own tokenizer of the GGUF at `gguf_path` (callers must not change it)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)
