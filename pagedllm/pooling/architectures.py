"""Which architectures run as pooling models, and as what: an encoder (BERT, RoBERTa,
XLM-RoBERTa, their cross-encoders: pooling/encoder_runner.py) or a decoder loaded without its
LM head (model/decoder_embedders.py, run by the paged model runner). Refused encoders are
named, never guessed at."""

from __future__ import annotations

from typing import Any

from pagedllm.model.decoder_embedders import HEADLESS_OF

EMBED_ARCHS = ("BertModel", "RobertaModel", "XLMRobertaModel")
CLASSIFY_ARCHS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                  "XLMRobertaForSequenceClassification")
# Encoders recognised and refused by name (transformers has them; pagedllm does not test them).
REFUSED_ARCHS = {
    "ModernBertModel": "ModernBERT is not supported yet (its alternating local/global attention is untested here)",
    "ModernBertForSequenceClassification": "ModernBERT is not supported yet",
    "BertForMaskedLM": "masked-LM heads are not a pooling task",
}


def encoder_architecture(hf_config: Any) -> str | None:
    """The supported encoder architecture a config names, None if it names none; refused
    encoders raise a ValueError naming them."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in REFUSED_ARCHS:
            raise ValueError(f"{arch}: {REFUSED_ARCHS[arch]}.")
        if arch in EMBED_ARCHS or arch in CLASSIFY_ARCHS:
            return arch
    return None


def decoder_architecture(hf_config: Any) -> str | None:
    """The headless architecture to load for a decoder config, None if it is no decoder the
    pooling runner serves."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in HEADLESS_OF.values():
            return arch
        if arch in HEADLESS_OF:
            return HEADLESS_OF[arch]
    return None
