"""Which proposer the engine core runs for `speculative_config.method`.

Apart from proposer.py because every method's proposer subclasses `Proposer` there: the choice
imports them all, and the base class imports none of them.
"""

from __future__ import annotations

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.proposer import NgramProposer, Proposer
from pagedllm.spec_decode.suffix import SuffixProposer

BUILT_METHODS = ("ngram", "suffix", "draft_model")


def make_proposer(config: SpeculativeConfig, max_model_len: int, draft_max_model_len: int | None = None,
                  max_catchup_tokens: int = 2048) -> Proposer:
    """The engine core's proposer for `config.method` (refused by name where not built).
    `draft_max_model_len`: how far a draft model proposes; `max_catchup_tokens`: the most
    tokens a draft model runs for one sequence in one step (spec_decode/draft_model.py)."""
    if config.method == "ngram":
        return NgramProposer(config, max_model_len)
    if config.method == "suffix":
        return SuffixProposer(config, max_model_len)
    if config.method == "draft_model":
        return DraftModelProposer(config, max_model_len, draft_max_model_len or max_model_len,
                                  max_catchup_tokens)
    raise ValueError(f"speculative method {config.method!r} is not built in pagedllm yet; "
                     f"built: {list(BUILT_METHODS)}.")
