"""Other architectures: tiny random Qwen2 / Mistral / Llama checkpoints saved by transformers,
run through the whole engine, greedy equal to transformers' `generate`.

transformers' side is stored (tests/references.py); the Llama checkpoint computes it live every
run, the Llama family's check (of the tiny checkpoints) that the store has not drifted."""

from __future__ import annotations


import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.references import reference
from tests.smollm2 import hf_tokenizer

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def _tokenizer(smollm2_gguf):
    return hf_tokenizer(smollm2_gguf)


def _save_tiny(kind: str, path, tokenizer):
    import transformers as tf

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    if kind == "qwen2":
        config = tf.Qwen2Config(tie_word_embeddings=True, rope_theta=1_000_000.0, **common)
        model_cls = tf.Qwen2ForCausalLM
    elif kind == "mistral":
        config = tf.MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)
        model_cls = tf.MistralForCausalLM
    else:
        config = tf.LlamaConfig(tie_word_embeddings=False, attention_bias=False, **common)
        model_cls = tf.LlamaForCausalLM
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    with torch.no_grad():  # random weights with enough spread that greedy isn't all one token
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif "bias" in str(p):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama"])
def test_tiny_model_greedy_matches_transformers(kind, tmp_path, smollm2_gguf):
    tok = _tokenizer(smollm2_gguf)
    hf_model = _save_tiny(kind, tmp_path, tok)
    prompts = ["Hello there, how are", "The quick brown fox", "1, 2, 3, 4,",
               "A much longer prompt that spans more than one block of sixteen tokens for sure."]
    llm = LLM(str(tmp_path), kv_cache_space=0.05, block_size=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20),
                        use_tqdm=False)
    prompt_ids = [list(out.prompt_token_ids) for out in outs]

    def compute():
        refs = []
        for p in prompt_ids:
            ids = torch.tensor([p])
            with torch.inference_mode():
                ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                        do_sample=False,
                                        pad_token_id=tok.eos_token_id)
            refs.append(ref[0, ids.shape[1]:].tolist())
        return refs

    refs = reference(f"tiny_models.{kind}.greedy", compute, sources=[tmp_path], live=kind == "llama",
                     inputs={"prompts": prompt_ids, "max_new_tokens": 20, "pad_token_id": tok.eos_token_id})
    for prompt, out, ref in zip(prompts, outs, refs):
        assert out.outputs[0].token_ids == ref, prompt
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 3  # not degenerate


def test_unknown_architecture_is_rejected(tmp_path, smollm2_gguf):
    import json

    tok = _tokenizer(smollm2_gguf)
    _save_tiny("llama", tmp_path, tok)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*Supported architectures"):
        LLM(str(tmp_path), kv_cache_space=0.05)
