"""A prompt's images as the engine carries them: each image one `MultiModalFeature` with its
processor tensors, its content hash and the placeholder runs its embedding rows fill.

msgspec Structs with no torch: they travel in `EngineCoreRequest`s to a core process and in
step plans to tensor-parallel ranks, and the scheduler reads their spans without tensors.
"""

from __future__ import annotations

import hashlib

import msgspec


class TensorData(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A tensor as bytes (no pickle): its dtype name (torch's, e.g. "float32"), shape, data."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_torch(cls, t) -> TensorData:
        import torch

        t = t.detach().contiguous().cpu()
        name = str(t.dtype).removeprefix("torch.")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(name, list(t.shape), raw)

    def to_torch(self):
        import torch

        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).view(self.shape)


class PlaceholderRun(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """`length` consecutive prompt positions from `offset` that take rows `row_start ..` of the
    item's embedding (an image split into tiles has one run per tile, text tokens between)."""

    offset: int
    length: int
    row_start: int


class MultiModalFeature(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One image of a prompt: its processor tensors (`data`, what the model's encoder takes for
    this one image), its identity (`content_hash`: sha256 of those tensors, which keys the
    encoder cache and the prefix-cache blocks its runs touch) and where its rows go."""

    modality: str
    content_hash: bytes
    runs: list[PlaceholderRun]
    data: dict[str, TensorData]
    # The whole item must be computed in one prefill chunk (attention inside the image is
    # bidirectional, Gemma 3): the scheduler never cuts a chunk inside [start, end).
    whole_in_one_chunk: bool = False
    # M-RoPE models (Qwen2-VL; multimodal/mrope.py): the rotary positions [3][rows] of the
    # image's tokens, and the offset of the text after it (its position - its index). None:
    # the model's rotary positions are the token indices.
    mrope_positions: list[list[int]] | None = None
    mrope_delta: int = 0

    @property
    def start(self) -> int:
        return self.runs[0].offset

    @property
    def end(self) -> int:
        last = self.runs[-1]
        return last.offset + last.length

    @property
    def num_rows(self) -> int:
        return sum(r.length for r in self.runs)

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def content_hash(modality: str, data: dict[str, TensorData]) -> bytes:
    """sha256 over the modality and every tensor's name, dtype, shape and bytes: the same image
    processed the same way hashes the same in every process (no Python `hash`)."""
    h = hashlib.sha256(modality.encode())
    for name in sorted(data):
        t = data[name]
        h.update(f"|{name}|{t.dtype}|{t.shape}|".encode())
        h.update(t.data)
    return h.digest()


def runs_in(features: tuple[MultiModalFeature, ...] | list[MultiModalFeature], start: int,
            end: int) -> list[tuple[bytes, int, int, int]]:
    """The parts of the features' runs inside positions [start, end), as (content hash,
    position, length, first row): what a step's runner puts into its input embeddings."""
    out = []
    for f in features:
        if not f.overlaps(start, end):
            continue
        for r in f.runs:
            a, b = max(start, r.offset), min(end, r.offset + r.length)
            if a < b:
                out.append((f.content_hash, a, b - a, r.row_start + a - r.offset))
    return out
