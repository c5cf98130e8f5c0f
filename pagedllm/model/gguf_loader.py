"""Read a llama.cpp GGUF file as transformers-named float tensors.

Tensors are read from the memory-mapped file (model/gguf_index.py), dequantized (Q4_0/Q4_1/Q8_0 in torch,
bit-identical to and several times faster than `gguf.quants.dequantize`, which handles the other
supported types), reshaped to the transformers shape (GGUF lists
dimensions innermost first), renamed (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.
weight`, ...), and llama.cpp's row permutation of the Q/K projections is undone for files whose
`general.architecture` is `llama` (Llama and Mistral checkpoints), exactly as transformers'
`LlamaTensorProcessor` does. Qwen2 files are not permuted by llama.cpp.

Gemma 2 / Gemma 3 files (`gemma2`, `gemma3`): llama.cpp names their four norms per layer
`attn_norm`, `post_attention_norm`, `ffn_norm` (the pre-feed-forward one) and `post_ffw_norm`,
and stores every norm weight as `1 + w`: one is subtracted, as transformers'
`Gemma2TensorProcessor` does. transformers' GGUF config reader drops some of their metadata
(the soft caps, Gemma 3's rope scaling; 27B's query_pre_attn_scalar, which llama.cpp infers from
the layer count); a file whose metadata disagrees with the config is refused by name
(`check_gemma_metadata`), rather than run with another model's numbers.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
import numpy as np
import torch

from pagedllm.quantization.formats.gguf_block_decoding import dequantize_tensor, tensor_view
from pagedllm.quantization.kernels.gguf_kernel import TYPES, GGUFTensor
from pagedllm.model.gguf_index import read_gguf_index

logger = logging.getLogger(__name__)
# Matrices of these types stay in the file's blocks (F32 ones are already the compute form).
KEPT_TYPES = frozenset(TYPES) - {"F32"}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
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
# Gemma's names where they differ from Llama's (llama.cpp's GEMMA2 / GEMMA3 tensors).
_GEMMA_BLOCK_NAMES = _BLOCK_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_ARCHITECTURES = {"gemma2", "gemma3"}
# layer count -> llama.cpp's 27B (query scale from hidden / heads, not head_dim)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_PERMUTED_ARCHITECTURES = {"llama"}


def supported_tensor_types() -> set[Any]:
    T = GGMLQuantizationType
    return {
        T.F32, T.F16, T.BF16,
        T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
        T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
    }  # fmt: skip


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """transformers name of a llama.cpp tensor name (of a file of `general.architecture`
    `architecture`); None for one to ignore; ValueError if unknown."""
    if name in _IGNORED:
        return None
    m = _BLOCK_RE.match(name)
    if m:
        layer, kind, suffix = m.groups()
        names = _GEMMA_BLOCK_NAMES if architecture in _GEMMA_ARCHITECTURES else _BLOCK_NAMES
        if kind in names:
            return f"model.layers.{layer}.{names[kind]}.{suffix}"
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


def gguf_architecture(index: Any) -> str:
    return str(index.fields["general.architecture"])


def _gguf_number(index: Any, key: str) -> float | None:
    value = index.fields.get(key)
    return None if value is None else float(value)


def _rope_factor(hf_config: Any, architecture: str) -> float:
    """The linear rope factor of the config's global layers (1: none)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if architecture == "gemma3":
        params = params.get("full_attention") or {}
    return float(params.get("factor", 1.0)) if params.get("rope_type", "default") != "default" else 1.0


def check_gemma_metadata(reader: Any, architecture: str, hf_config: Any) -> None:
    """ValueError naming each Gemma parameter where the file's metadata (llama.cpp's values) and
    `hf_config` (what transformers' GGUF config reader made of it) disagree: the soft caps, the
    global layers' rope scaling, the attention scale (llama.cpp: hidden / heads for the 27B
    models, head_dim otherwise)."""
    mismatches = []

    def compare(what: str, in_file: float | None, in_config: Any) -> None:
        if in_file is not None and (in_config is None or abs(float(in_config) - in_file) > 1e-6 * max(1.0, in_file)):
            mismatches.append(f"{what}: file {in_file:g}, config {in_config}")

    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        config_value = getattr(hf_config, key, None)
        if not (architecture == "gemma3" and key == "attn_logit_softcapping"):  # Gemma 3 does not use it
            compare(key, _gguf_number(reader, f"{architecture}.{key}"), config_value)
    factor = _gguf_number(reader, f"{architecture}.rope.scaling.factor")
    if factor is not None and factor != 1.0:
        compare("rope scaling factor", factor, _rope_factor(hf_config, architecture))
    heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
    is_27b = hf_config.num_hidden_layers == _GEMMA_27B_LAYERS[architecture]
    expected = hidden // heads if is_27b else (getattr(hf_config, "head_dim", None) or hidden // heads)
    compare("query_pre_attn_scalar (llama.cpp: hidden / heads for 27B, else head_dim)", float(expected),
            getattr(hf_config, "query_pre_attn_scalar", None))
    if mismatches:
        raise ValueError(f"This {architecture} GGUF file's metadata disagrees with its transformers config "
                         f"(transformers' GGUF reader does not carry these): {'; '.join(mismatches)}. "
                         "Use the safetensors checkpoint, or pass a config that has the file's values.")


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


Cuts = list[tuple[int, int, int]]  # (dim, start, length) of the transformers-shaped tensor


def cut_gguf_data(data: np.ndarray, tensor_type: Any, shape: tuple[int, ...], cuts: Cuts
                  ) -> tuple[np.ndarray, tuple[int, ...], Cuts]:
    """A tensor-parallel rank's part of a GGUF tensor, cut in the file's own layout before
    anything is dequantized: rows (dim 0) are whole in every type; columns (dim 1) are cut along
    whole quantization blocks. Returns the cut data, its shape, and the cuts left to apply to
    the values (a column cut inside a block, which is done after dequantizing those rows)."""
    shape = list(shape)
    left: Cuts = []
    for dim, start, length in cuts:
        if start < 0 or start + length > shape[dim]:
            raise ValueError(f"GGUF tensor of shape {tuple(shape)}: a cut {start}..{start + length - 1} of "
                             f"dimension {dim} is out of range")
        if dim == 0:
            data = data[start:start + length]
        elif dim == 1 and len(shape) == 2:
            block, type_size = GGML_QUANT_SIZES[tensor_type]
            if start % block or length % block:
                left.append((dim, start, length))
                continue
            rows = data.reshape(shape[0], shape[1] // block, type_size)
            data = rows[:, start // block:(start + length) // block].reshape(shape[0], -1)
        else:
            raise ValueError(f"GGUF tensor of shape {tuple(shape)} cannot be cut along dimension {dim}")
        shape[dim] = length
    return data, tuple(shape), left


def _apply_cuts(t: torch.Tensor, cuts: Cuts) -> torch.Tensor:
    for dim, start, length in cuts:
        t = t.narrow(dim, start, length)
    return t.contiguous() if cuts else t


def iter_gguf_weights(path: str, hf_config: Any, keep_blocks: bool = False, slices_of=None
                      ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """Yield `(transformers name, tensor)` for every tensor of the GGUF file at `path`: float
    values, or with `keep_blocks` a `GGUFTensor` for each matrix of a quantized or 16-bit type
    (`KEPT_TYPES`): the file's own bytes, a view of the memory-mapped file unless its rows are
    reordered (Q/K) or cut (tensor parallelism), so the model takes the file's size. The linear
    layers, the embedding and the LM head read them in place (quantization/gguf_kernel.py).

    `slices_of(name, shape) -> cuts` (a tensor-parallel model's `checkpoint_slices`): yield only
    this rank's part of each tensor, cut from the memory-mapped file before it is converted
    (Q/K rows are cut by whole heads, then un-permuted per head)."""
    reader = read_gguf_index(path)
    architecture = gguf_architecture(reader)
    permute = architecture in _PERMUTED_ARCHITECTURES
    gemma = architecture in _GEMMA_ARCHITECTURES
    if gemma:
        check_gemma_metadata(reader, architecture, hf_config)
    n_head = hf_config.num_attention_heads
    n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_head
    supported = supported_tensor_types()
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name, architecture)
        if hf_name is None:
            continue
        if tensor.tensor_type not in supported:
            names = sorted(t.name for t in supported)
            raise ValueError(
                f"Unsupported GGUF tensor type {tensor.tensor_type.name} for tensor {tensor.name!r}; "
                f"supported types: {names}"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))
        data, left = tensor.data, []
        cuts = slices_of(hf_name, shape) if slices_of is not None else []
        if cuts:
            data, shape, left = cut_gguf_data(data, tensor.tensor_type, shape, cuts)
        heads = n_head if ".self_attn.q_proj." in hf_name else n_kv_head
        if cuts and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
            heads = shape[0] // head_dim  # this rank's (whole) heads
        if keep_blocks and not left and len(shape) == 2 and tensor.tensor_type.name in KEPT_TYPES:
            weight = GGUFTensor(tensor_view(data.view(np.uint8)).reshape(shape[0], -1), tensor.tensor_type.name, shape)
            if permute and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
                weight = weight.permute_rows(lambda t: reverse_permute(t, heads))  # a copy of those rows
            yield hf_name, weight
            continue
        weight = dequantize_tensor(data, tensor.tensor_type).reshape(shape)
        if keep_blocks and len(shape) == 2 and tensor.tensor_type.name != "F32":
            logger.warning("GGUF tensor %s (%s) widened to float32: %d bytes instead of the file's %d (%s)",
                           tensor.name, tensor.tensor_type.name, weight.numel() * 4, data.nbytes,
                           "a tensor-parallel cut inside a block" if left else "a type kept only as floats")
        if permute and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
            weight = reverse_permute(weight, heads)
        if gemma and tensor.name.endswith("norm.weight"):
            weight = weight.float() - 1.0  # llama.cpp stores Gemma's norms as 1 + w
        yield hf_name, _apply_cuts(weight, left)
