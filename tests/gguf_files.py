"""GGUF files made from the default model for tests: its metadata and tokenizer as they are, its
matrices re-encoded in other types (the way llama.cpp's quantizer would lay them out).

`smollm2_q4_k_m_like` mirrors what `llama-quantize ... Q4_K_M` makes of SmolLM2 (whose 576-wide
rows are not whole super-blocks of 256): Q5_0 / Q5_1 / Q8_0 for the 576-wide matrices, K-quants
for ffn_down (1536 wide) — here Q4_K and Q6_K alternating by layer — and a Q8_0 token table
(the tied head). gguf-py quantizes the legacy types from the real weights; it has no K-quant
quantizer, so ffn_down gets random valid blocks of the weights' size (tests/gguf_random.py):
the model then talks nonsense, but transformers and pagedllm read the very same values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.gguf_random import random_tensor


def _mix(name: str, rows: int, cols: int) -> str:
    kind = name.split(".")[-2]
    if kind == "ffn_down":
        return "Q4_K" if int(name.split(".")[1]) % 2 == 0 else "Q6_K"
    return {"attn_v": "Q8_0", "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "token_embd": "Q8_0"}.get(kind, "Q5_0")


def rewrite_gguf(src: str, dst: Path, type_of=_mix) -> Path:
    """`src` with each 2-D matrix re-encoded in `type_of(name, rows, cols)`; everything else
    (metadata, tokenizer, norms) copied as it is."""
    import gguf
    from gguf.quants import quantize

    from pagedllm.quantization.formats.gguf_block_decoding import dequantize_tensor

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for seed, tensor in enumerate(reader.tensors):
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = dequantize_tensor(tensor.data, tensor.tensor_type).reshape(shape).float().numpy()
        if len(shape) != 2:
            writer.add_tensor(tensor.name, values.astype(np.float32))
            continue
        qtype = gguf.GGMLQuantizationType[type_of(tensor.name, *shape)]
        if qtype.name in ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL"):
            data = random_tensor(qtype.name, *shape, seed=seed, typical=float(np.abs(values).mean()))
        else:
            data = quantize(values, qtype)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
