"""Developer check (not CI): pagedllm's AWQ reader and writer against AutoAWQ's own code
(`WQLinear_GEMM.from_linear`, the packer AutoAWQ's quantizer calls, and `dequantize_gemm`).
AutoAWQ is deprecated and its package imports datasets/transformers-4 on import, so this loads
its modules from the unpacked sdist without running `awq/__init__.py`:

  pip download --no-deps -d /tmp/awq-dl autoawq && tar xzf /tmp/awq-dl/autoawq-*.tar.gz -C /tmp/awq-dl
  AUTOAWQ_SRC=/tmp/awq-dl/autoawq-0.2.9 python benchmarks/check_autoawq.py

1. For each projection of a tiny random Llama, our RTN's scales and zeros packed by AutoAWQ's
   `from_linear` give the same qweight / qzeros / scales as `pagedllm quantize --format awq`.
2. pagedllm loads a folder of AutoAWQ-packed tensors with every weight equal, bit for bit, to
   AutoAWQ's `dequantize_gemm` of them (taken with float32 scales: both products exact).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

from benchmarks.tiny_llama import save_tiny_llama

import torch


def main() -> int:
    src = os.environ.get("AUTOAWQ_SRC", "/tmp/awq-dl/autoawq-0.2.9")
    pkg = types.ModuleType("awq")
    pkg.__path__ = [os.path.join(src, "awq")]
    sys.modules["awq"] = pkg
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from check_compressed_tensors import _layer_weights

    from pagedllm.model.loader import load_model
    from pagedllm.model_source import load_hf_config, resolve_model
    from pagedllm.quantization.algorithms.checkpoint_writer import quantize_model, rtn_quantize

    ok = True
    tmp = Path(tempfile.mkdtemp())
    model = save_tiny_llama(tmp / "src")
    for gs in (32, 16):
        ours = load_file(str(quantize_model(str(tmp / "src"), str(tmp / f"ours-{gs}"), fmt="awq", group_size=gs)
                             / "model.safetensors"))
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        same_packing, intended = True, {}
        for name in [n for n in sd if n.endswith("_proj.weight") and ".layers." in n]:
            module = name[: -len(".weight")]
            codes, scale, zero = rtn_quantize(sd[name], 4, gs, sym=False)
            gidx = torch.arange(codes.shape[1]) // gs
            w = (codes - zero[:, gidx]).float() * scale.float()[:, gidx]  # on the grid
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            q = WQLinear_GEMM.from_linear(lin, 4, gs, scales=scale.t().contiguous(), zeros=zero.t().float().contiguous())
            theirs = {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}
            same_packing &= all(torch.equal(theirs[k], ours[f"{module}.{k}"]) for k in theirs)
            del sd[name]
            sd.update({f"{module}.{k}": v.contiguous() for k, v in theirs.items()})
            intended[module] = dequantize_gemm(q.qweight, q.qzeros, q.scales.float(), 4, gs).t()
        print(f"{'OK  ' if same_packing else 'FAIL'} AutoAWQ from_linear packing == pagedllm quantize, group {gs}")
        folder = tmp / f"theirs-{gs}"
        folder.mkdir()
        save_file(sd, str(folder / "model.safetensors"))
        cfg = json.loads((tmp / "src" / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True,
                                      "version": "gemm"}
        (folder / "config.json").write_text(json.dumps(cfg))
        loaded = _layer_weights(load_model(str(folder), None, load_hf_config(resolve_model(str(folder))),
                                           torch.float32, "cpu"))
        same = loaded.keys() == intended.keys() and all(torch.equal(loaded[k], intended[k]) for k in loaded)
        print(f"{'OK  ' if same else 'FAIL'} AutoAWQ-packed folder loads equal to its dequantize_gemm, group {gs} "
              f"({len(loaded)} layers)")
        ok &= same_packing and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
