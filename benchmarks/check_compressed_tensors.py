"""Developer check (not CI): pagedllm's compressed-tensors reader against the `compressed-tensors`
library itself (llm-compressor's writer). Needs `pip install compressed-tensors loguru` (here:
`pip install --target /tmp/ct-pkgs --no-deps compressed-tensors loguru`, then PYTHONPATH=/tmp/ct-pkgs).

1. Its `pack_to_int32` / `unpack_from_int32` (4 and 8 bits, both packed dims) against ours.
2. Its `PackedQuantizationCompressor.compress` writes each projection of a tiny random Llama
   (scales and zero points from our RTN, W chosen on that grid); pagedllm loads the folder and
   every layer's weight must equal the intended W bit for bit.
3. A folder written by `pagedllm quantize --format compressed-tensors`, decompressed by its
   `decompress`: equal, bit for bit, to what pagedllm loads (scales taken in float32 so that
   both products are exact).

python benchmarks/check_compressed_tensors.py   -> prints one line per check, exits 1 on a mismatch
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.tiny_llama import save_tiny_llama

import torch


def _layer_weights(llm_model) -> dict[str, torch.Tensor]:
    """{checkpoint module name: float32 W [out, in]} of every quantized projection."""
    from pagedllm.layers.linear import Linear
    from pagedllm.model.llama_checkpoint import _SHARD_NAMES

    out = {}
    for name, m in llm_model.named_modules():
        if isinstance(m, Linear) and m.quant_method is not None:
            w = m.quant_method.dequantized_weight(m)
            if m.perm is not None:
                w = torch.empty_like(w).index_copy_(0, m.perm, w)
            w = w.t()
            parent, _, leaf = name.rpartition(".")
            for shard, (off, size) in enumerate(zip([sum(m.output_sizes[:i]) for i in range(len(m.output_sizes))],
                                                    m.output_sizes)):
                ck = _SHARD_NAMES.get(leaf, [leaf])[shard]
                out[f"{parent}.{ck}"] = w[off:off + size]
    return out


def main() -> int:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    from pagedllm.quantization.formats.packing import pack_int32, unpack_int32
    from pagedllm.model.loader import load_model
    from pagedllm.model_source import load_hf_config, resolve_model
    from pagedllm.quantization.algorithms.checkpoint_writer import quantize_model, rtn_quantize

    ok = True

    def report(what: str, good: bool) -> None:
        nonlocal ok
        ok &= good
        print(f"{'OK  ' if good else 'FAIL'} {what}")

    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        for dim in (0, 1):
            q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (32, 64), generator=g, dtype=torch.int8)
            theirs = pack_to_int32(q, bits, packed_dim=dim)
            ours = pack_int32(q.to(torch.int32) + (1 << (bits - 1)), bits, dim)
            back = unpack_from_int32(ours, bits, q.shape, packed_dim=dim)
            report(f"pack_to_int32 == pack_int32, {bits} bits, dim {dim}", torch.equal(theirs, ours))
            report(f"unpack_from_int32(ours) == codes, {bits} bits, dim {dim}", torch.equal(back, q))
            report(f"unpack_int32(theirs) == codes, {bits} bits, dim {dim}",
                   torch.equal(unpack_int32(theirs, bits, dim) - (1 << (bits - 1)), q.to(torch.int32)))

    tmp = Path(tempfile.mkdtemp())
    model = save_tiny_llama(tmp / "src")
    for bits, sym, gs in ((4, True, 32), (4, False, 16), (8, False, -1)):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym,
                                strategy="channel" if gs == -1 else "group", group_size=None if gs == -1 else gs)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        intended = {}
        for name in [n for n in sd if n.endswith("_proj.weight") and ".layers." in n]:
            codes, scale, zero = rtn_quantize(sd[name], bits, gs, sym)
            off = 1 << (bits - 1)
            gidx = torch.arange(codes.shape[1]) // (codes.shape[1] if gs == -1 else gs)
            w = (codes - zero[:, gidx]).float() * scale.float()[:, gidx]
            module = name[: -len(".weight")]
            intended[module] = w
            local = {"weight": w, "weight_scale": scale, "weight_zero_point": (zero - off).to(torch.int8)}
            del sd[name]
            for k, v in PackedQuantizationCompressor.compress(local, scheme).items():
                sd[f"{module}.{k}"] = v
        folder = tmp / f"theirs-{bits}-{sym}-{gs}"
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
        cfg = json.loads((tmp / "src" / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "quantization_status": "compressed", "ignore": ["lm_head"],
                                      "config_groups": {"group_0": scheme.model_dump()}}
        (folder / "config.json").write_text(json.dumps(cfg))
        loaded = load_model(str(folder), None, load_hf_config(resolve_model(str(folder))), torch.float32, "cpu")
        ours = _layer_weights(loaded)
        report(f"their compressor's W{bits}A16 sym={sym} group={gs} folder loads bit for bit ({len(ours)} layers)",
               ours.keys() == intended.keys() and all(torch.equal(ours[k], intended[k]) for k in ours))

        out = quantize_model(str(tmp / "src"), str(tmp / f"ours-{bits}-{sym}-{gs}"), fmt="compressed-tensors",
                             bits=bits, group_size=gs, sym=sym)
        tensors = load_file(str(out / "model.safetensors"))
        loaded = _layer_weights(load_model(str(out), None, load_hf_config(resolve_model(str(out))),
                                           torch.float32, "cpu"))
        same = True
        for module, w in loaded.items():
            local = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == module}
            local["weight_scale"] = local["weight_scale"].float()
            same &= torch.equal(PackedQuantizationCompressor.decompress(local, scheme)["weight"], w)
        report(f"their decompress of `pagedllm quantize` W{bits}A16 sym={sym} group={gs} == pagedllm's weights", same)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
