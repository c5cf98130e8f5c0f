"""The tiny random Llama the developer checks against third-party quantizers start from."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(path: Path):
    """A 2-layer random Llama (hidden 64, GQA 4/2), seeded, saved as an HF folder at `path`;
    returns the model."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model
