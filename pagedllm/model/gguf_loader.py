"""Read a llama.cpp GGUF file as transformers-named float tensors.

Tensors are dequantized with the `gguf` package, reshaped to the transformers shape (GGUF lists
dimensions innermost first), renamed (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.
weight`, ...), and llama.cpp's row permutation of the Q/K projections is undone for files whose
`general.architecture` is `llama` (Llama and Mistral checkpoints), exactly as transformers'
`LlamaTensorProcessor` does. Qwen2 files are not permuted by llama.cpp.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_Q = None  # gguf.GGMLQuantizationType, imported lazily with gguf

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors some converters add that the model recomputes from its config.
_IGNORED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_PERMUTED_ARCHITECTURES = {"llama"}


def supported_tensor_types() -> set[Any]:
    from gguf import GGMLQuantizationType as T

    return {
        T.F32, T.F16, T.BF16,
        T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
        T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    }  # fmt: skip


def gguf_to_hf_name(name: str) -> str | None:
    """transformers name of a llama.cpp tensor name; None for one to ignore; ValueError if unknown."""
    if name in _IGNORED:
        return None
    m = _BLOCK_RE.match(name)
    if m:
        layer, kind, suffix = m.groups()
        if kind in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
    else:
        base, _, suffix = name.rpartition(".")
        if base in _TOP_NAMES and suffix in ("weight", "bias"):
            return f"{_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"Unsupported tensor {name!r} in GGUF file (not a Llama-family tensor)")


def reverse_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (per head, interleaved -> rotate-half layout)."""
    shape = w.shape
    dim = shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def gguf_architecture(reader: Any) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def resolve_gguf_path(model_path: str, gguf_file: str | None) -> str | None:
    """The GGUF file to read: `gguf_file` (absolute, or inside `model_path`), or `model_path`
    itself when it names a `.gguf` file; None for a transformers folder."""
    if gguf_file is not None:
        path = gguf_file if os.path.isabs(gguf_file) else os.path.join(model_path, gguf_file)
    elif model_path.endswith(".gguf") and os.path.isfile(model_path):
        path = model_path
    else:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return path


def iter_gguf_weights(path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(transformers name, float32 tensor)` for every tensor of the GGUF file at `path`."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    permute = gguf_architecture(reader) in _PERMUTED_ARCHITECTURES
    n_head = hf_config.num_attention_heads
    n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
    supported = supported_tensor_types()
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        if tensor.tensor_type not in supported:
            names = sorted(t.name for t in supported)
            raise ValueError(
                f"Unsupported GGUF tensor type {tensor.tensor_type.name} for tensor {tensor.name!r}; "
                f"supported types: {names}"
            )
        array = dequantize(tensor.data, tensor.tensor_type)
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if not array.flags.writeable:
            array = np.array(array)  # memory-mapped F32 data: torch needs a writable buffer
        weight = torch.from_numpy(array)
        if permute and ".self_attn.q_proj." in hf_name:
            weight = reverse_permute(weight, n_head)
        elif permute and ".self_attn.k_proj." in hf_name:
            weight = reverse_permute(weight, n_kv_head)
        yield hf_name, weight
