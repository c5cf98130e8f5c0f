"""The language model of Qwen2-VL and Qwen2.5-VL (`qwen2_vl_text` / `qwen2_5_vl_text`): Qwen2's
decoder (q/k/v biases, no o bias; model/llama.py) whose rotary embedding is M-RoPE
(layers/mrope.py): positions `[3, T]` (temporal, height, width) for prefill chunks that hold
image tokens, `[T]` otherwise.

Which positions a token gets is decided outside the model: the front end computes the prompt's
3-D positions once with transformers' `get_rope_index` (multimodal/mrope.py), the step planner
gives each chunk its part, and the runner passes them (worker/mrope_positions.py); the 1-D
position keeps driving the KV slots. Everything else is the Llama class's own, so decode steps
(1-D positions shifted by the prompt's `rope_deltas`) still run in the C decode step and in
compiled graphs.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.mrope import MRotaryEmbedding
from pagedllm.model.llama import LlamaForCausalLM


class Qwen2VLTextForCausalLM(LlamaForCausalLM):
    """Qwen2 with M-RoPE: the text part of `Qwen2VLForConditionalGeneration` and
    `Qwen2_5_VLForConditionalGeneration` (model/multimodal.py adds the vision encoder)."""

    # The model runner passes rotary positions apart from the KV slots' (worker/mrope_positions.py).
    uses_mrope = True

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 **kwargs: Any) -> None:
        super().__init__(config, dtype=dtype, device=device, **kwargs)
        # The decoder stays a plain LlamaModel (what the C decode step describes); only its rotary
        # embedding takes 3-D positions.
        self.model.rotary_emb = MRotaryEmbedding.from_config(config, device=device)
