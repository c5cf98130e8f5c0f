"""Quantization formats (see pagedllm/quantization/__init__.py)."""
