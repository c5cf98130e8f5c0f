"""Quantization kernels (see pagedllm/quantization/__init__.py)."""
