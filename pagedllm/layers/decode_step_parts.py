"""What a linear layer tells the C decode step (kernels/decode_step.c) about its product.

A layer's method (quantization/base.LinearMethod.decode_step_parts) describes the product
it would run eagerly at a row bucket as a list of `StepPart`s — which C function, on which
weight, with which parameters — or None where that product is not one of the C kernels' (a
bucket where torch's op was kept, a form the step does not call, LoRA). The step then makes
exactly the calls the eager path makes, from C (worker/cpu_decode_step.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.kernels import gguf_gemm_kernel, int_gemm_kernel
from pagedllm.quantization.kernels.gguf_kernel import part_compute

# kernels/decode_step.c's `op` codes
OP_INT_EXACT, OP_INT_INT8, OP_GGUF_EXACT, OP_GGUF_INT8, OP_PACKED_F32 = 1, 2, 3, 4, 5
_X_CHUNK_ROWS = 144  # packed_gemm.c's M_CHUNK: exact-path scratch holds one chunk of packed rows
_PANEL_MIN_ROWS = 17  # int_gemm.c / gguf_gemm.c: from here on the exact path packs rows in scratch


class StepPart(NamedTuple):
    op: int
    weight: torch.Tensor  # the form the kernel reads (kept alive by the layer)
    rows: int  # output columns this part writes
    in_features: int
    bits: int = 0  # int_gemm.c's
    kind: int = 0
    group_size: int = 0
    gguf_type: int = 0  # gguf_gemm.c's type id

    def scratch_bytes(self, m: int) -> int:
        """Bytes of scratch this part's kernel needs at `m` rows (what the eager wrapper allocates)."""
        if self.op in (OP_INT_EXACT, OP_GGUF_EXACT):
            return 4 * min(m, _X_CHUNK_ROWS) * self.in_features if m >= _PANEL_MIN_ROWS else 0
        if self.op == OP_PACKED_F32:
            return 4 * min(m, _X_CHUNK_ROWS) * self.in_features
        if self.op == OP_INT_INT8:
            return int(int_gemm_kernel().int8_scratch(m, self.in_features))
        return int(gguf_gemm_kernel().int8_scratch(m, self.in_features))


def int_weight_parts(w, compute: str, bucket: int) -> list[StepPart] | None:
    """The part of an int_gemm.c weight (quantization/int_kernel.PackedIntWeight) at `bucket`:
    its chosen path there (`compute` when no choice was made), None where torch's op is kept."""
    path = compute if w.paths is None else w.paths[bucket]
    if path not in ("exact", "int8"):
        return None
    return [StepPart(OP_INT_EXACT if path == "exact" else OP_INT_INT8, w.data, w.out_features, w.in_features,
                     w.bits, w.kind, w.group_size)]


def gguf_parts(parts, compute: str) -> list[StepPart]:
    """The parts of a layer read in place from a GGUF file's blocks (gguf_kernel.GGUFTensor list),
    each on the path `gguf_kernel.gguf_linear` takes for it."""
    return [StepPart(OP_GGUF_INT8 if part_compute(p.type_name, compute) == "int8" else OP_GGUF_EXACT, p.data,
                     p.shape[0], p.shape[1], gguf_type=p.type_id) for p in parts]
