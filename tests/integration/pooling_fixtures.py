"""Tiny random pooling checkpoints (no Hub): a WordPiece tokenizer written from a word list,
and BERT / XLM-RoBERTa / cross-encoder / decoder-embedder folders built with transformers'
own classes, optionally wrapped as sentence-transformers folders."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("the a an of to in is was for on with as by at from and or not this that it be are "
         "paris france capital city river cat dog tree house water fire earth music book "
         "computer science model engine memory cache token query document passage answer "
         "question small large fast slow red blue green one two three four five six seven "
         "eight nine ten what where when who how why which").split()


def write_tokenizer(folder: Path, token_types: bool = True):
    """A BertTokenizerFast over a small vocabulary (special tokens, words, letters and
    ##letters, so that any lowercase ASCII text tokenizes), saved into `folder`. Without
    `token_types` it returns no token_type_ids (as XLM-RoBERTa's tokenizer)."""
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,?!'-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters, *("##" + c for c in letters)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    tok = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True, model_input_names=names)
    tok.save_pretrained(folder)
    return tok


def _perturb(model, seed: int) -> None:
    """LayerNorm weights start at ones and biases at zeros: perturb them so loading is tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "LayerNorm" in name or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def encoder_config(arch: str, vocab_size: int, **overrides):
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=130, type_vocab_size=2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if arch == "xlm-roberta":
        # RoBERTa counts positions from pad_token_id + 1: the tokenizer's [PAD] is 0
        common.update(pad_token_id=0, type_vocab_size=1, max_position_embeddings=132)
        common.update(overrides)
        return XLMRobertaConfig(**common)
    common.update(overrides)
    return BertConfig(**common)


def save_encoder(folder: Path, arch: str = "bert", classifier_labels: int = 0, seed: int = 0):
    """A tiny random BERT / XLM-RoBERTa (`*Model`, or `*ForSequenceClassification` with
    `classifier_labels` labels) and its tokenizer in `folder`; returns the transformers model."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    tok = write_tokenizer(folder, token_types=arch == "bert")
    config = encoder_config(arch, len(tok), **({"num_labels": classifier_labels} if classifier_labels else {}))
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if classifier_labels else AutoModel
    model = cls.from_config(config).eval()
    _perturb(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def save_decoder_embedder(folder: Path, arch: str = "qwen3", seed: int = 0):
    """A tiny random decoder without an LM head (`Qwen3Model` / `LlamaModel`), as
    Qwen3-Embedding and e5-mistral are used, with the WordPiece tokenizer."""
    from transformers import AutoModel, LlamaConfig, Qwen3Config

    tok = write_tokenizer(folder)
    cfg_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    config = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
                     pad_token_id=0, head_dim=16)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32).eval()
    _perturb(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return model
