"""The quantization algorithms behind `pagedllm quantize` (pagedllm/quantization/algorithms/checkpoint_writer.py writes the
checkpoint formats):

- `grid.py`: the integer grid every method ends on (per group of input columns and output row:
  a float16 scale and an integer zero point), and round to nearest on it (`--method rtn`).
- `gptq.py`: GPTQ (Frantar et al.): Hessian-based error compensation per linear layer.
- `awq.py`: AWQ (Lin et al., as AutoAWQ does it): activation-aware scale search and clipping.
- `calibration.py`: the shipped calibration / held-out texts, tokenized into samples.
- `block.py`: a plain-torch float Llama decoder layer over calibration batches, in pieces, so
  that the methods can read each linear layer's input.
- `pipeline.py`: the layer-by-layer drivers (GPTQ and AWQ) over a model's float weights.
"""
