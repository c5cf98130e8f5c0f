"""Parameters of `LLM.beam_search` (vLLM's `BeamSearchParams`), checked when they are made.

Apart from `SamplingParams` because beam search is its own decoding loop (engine/beam_search.py)
with its own few knobs; both are importable from `pagedllm.sampling_params`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.value_checks import as_float, check_int, check_length_penalty


@dataclass
class BeamSearchParams:
    """Beam search parameters (vLLM's `BeamSearchParams`), used by `LLM.beam_search`.

    `early_stopping` is transformers' (`generate(..., early_stopping=...)`): True stops as
    soon as `beam_width` hypotheses are finished; False (default) stops when the best running
    beam, scored at its current length, cannot beat the worst finished one; "never" scores it
    at `max_tokens` when `length_penalty > 0` (the exact, slower search).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}."
            )
        check_int("beam_width", self.beam_width)
        check_int("max_tokens", self.max_tokens)
        self.temperature = as_float("temperature", self.temperature)
        self.length_penalty = as_float("length_penalty", self.length_penalty)
        check_length_penalty(self.length_penalty)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
