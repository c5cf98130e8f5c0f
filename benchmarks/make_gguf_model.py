"""Write a Hub-shaped GGUF file of random weights, tensor by tensor (never a float32 model in memory).

The type mix follows llama.cpp's Q4_K_M (`--mix q4_k_m`): Q4_K everywhere except attn_v and
ffn_down in the first and last eighth of the layers and every third layer in between, which are
Q6_K, and the token table (tied head) in Q6_K; rows that are not whole super-blocks of 256 fall
back to Q5_0 / Q8_0 as llama.cpp's do; `--mix q8_0` / `q4_0` / ... puts every matrix in one
type. Blocks are random with scales of trained-weight size (tests/gguf_random.py), so speed and
memory are those of a real file of that shape. The tokenizer is the default model's (SmolLM2),
padded with unused tokens up to the model's vocabulary. Shapes: `qwen2-1.5b` (Qwen2.5-1.5B),
`qwen2-0.5b`, `llama-7b` (Llama-2-7B), `gemma3-270m` (Gemma 3 270M: head_dim 256, q/k norms,
four norms a layer stored as llama.cpp stores them, 1 + w, sliding window 512 on five layers
of six).

    python -m benchmarks.make_gguf_model qwen2-1.5b /tmp/qwen2-1.5b-Q4_K_M.gguf [--mix q4_k_m]
"""

from __future__ import annotations

import argparse

import numpy as np

from tests.gguf_random import random_tensor

SHAPES = {  # arch, hidden, intermediate, layers, heads, kv heads, vocab, tied
    "qwen2-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 151936, True),
    "qwen2-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 151936, True),
    "llama-7b": ("llama", 4096, 11008, 32, 32, 32, 32000, False),
    "gemma3-270m": ("gemma3", 640, 2048, 18, 4, 1, 262144, True),
}
HEAD_DIM = {"gemma3": 256}  # where it is not hidden / heads


def _q4_k_m_type(kind: str, layer: int, layers: int) -> str:
    if kind in ("attn_v", "ffn_down"):
        important = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        return "Q6_K" if important else "Q4_K"
    if kind in ("token_embd", "output"):
        return "Q6_K"
    return "Q4_K"


def _copy_tokenizer(writer, source: str, vocab: int) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|unused_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [5] * (vocab - len(value))  # UNUSED
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)


def write_model(shape: str, path: str, mix: str, tokenizer_gguf: str) -> None:
    import gguf

    arch, hidden, inter, layers, heads, kv_heads, vocab, tied = SHAPES[shape]
    head_dim = HEAD_DIM.get(arch, hidden // heads)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"random {shape} {mix}")
    writer.add_context_length(32768 if arch in ("qwen2", "gemma3") else 4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1e6 if arch == "qwen2" else 1e4)
    writer.add_layer_norm_rms_eps(1e-6 if arch == "qwen2" else 1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(512)
    _copy_tokenizer(writer, tokenizer_gguf, vocab)

    tensors: list[tuple[str, str, tuple[int, ...]]] = []  # name, type, (rows, cols) or (n,)
    tensors.append(("token_embd.weight", "token_embd", (vocab, hidden)))
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", "norm", (hidden,)), (b + "ffn_norm.weight", "norm", (hidden,)),
                    (b + "attn_q.weight", "attn_q", (heads * head_dim, hidden)),
                    (b + "attn_k.weight", "attn_k", (kv_heads * head_dim, hidden)),
                    (b + "attn_v.weight", "attn_v", (kv_heads * head_dim, hidden)),
                    (b + "attn_output.weight", "attn_output", (hidden, heads * head_dim)),
                    (b + "ffn_gate.weight", "ffn_gate", (inter, hidden)),
                    (b + "ffn_up.weight", "ffn_up", (inter, hidden)),
                    (b + "ffn_down.weight", "ffn_down", (hidden, inter))]
        if arch == "gemma3":
            tensors += [(b + "attn_q_norm.weight", "norm", (head_dim,)), (b + "attn_k_norm.weight", "norm", (head_dim,)),
                        (b + "post_attention_norm.weight", "norm", (hidden,)),
                        (b + "post_ffw_norm.weight", "norm", (hidden,))]
        if arch == "qwen2":
            tensors += [(b + "attn_q.bias", "bias", (heads * head_dim,)), (b + "attn_k.bias", "bias", (kv_heads * head_dim,)),
                        (b + "attn_v.bias", "bias", (kv_heads * head_dim,))]
    tensors.append(("output_norm.weight", "norm", (hidden,)))
    if not tied:
        tensors.append(("output.weight", "output", (vocab, hidden)))

    def type_of(name: str, kind: str) -> str:
        if kind in ("norm", "bias"):
            return "F32"
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        chosen = _q4_k_m_type(kind, layer, layers) if mix == "q4_k_m" else mix.upper()
        cols = dict((n, d) for n, _, d in tensors)[name][-1]
        if chosen.endswith("_K") and cols % 256:  # llama.cpp's fallback for rows that are not whole super-blocks
            chosen = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(chosen, "Q8_0")
        return chosen

    def data_of(name: str, kind: str, dims: tuple[int, ...], seed: int) -> np.ndarray:
        t = type_of(name, kind)
        if kind == "norm":
            return np.ones(dims, np.float32)
        if kind == "bias":
            return (np.random.default_rng(seed).standard_normal(dims) * 0.02).astype(np.float32)
        return random_tensor(t, dims[0], dims[1], seed=seed, typical=0.02)

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for seed, (name, kind, dims) in enumerate(tensors):
        t = GGMLQuantizationType[type_of(name, kind)]
        block, size = GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(dims)) // block * size
        if t.name == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=t)
        else:  # gguf-py takes a quantized tensor's shape in bytes per row
            writer.add_tensor_info(name, (dims[0], dims[1] // block * size), np.dtype(np.uint8), nbytes, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for seed, (name, kind, dims) in enumerate(tensors):
        writer.write_tensor_data(data_of(name, kind, dims, seed))
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("path")
    p.add_argument("--mix", default="q4_k_m")
    p.add_argument("--tokenizer-gguf", default=None, help="default: the default model's file")
    args = p.parse_args()
    if args.tokenizer_gguf is None:
        from pagedllm.model_source import default_model_path

        args.tokenizer_gguf = str(default_model_path())
    write_model(args.shape, args.path, args.mix, args.tokenizer_gguf)


if __name__ == "__main__":
    main()
