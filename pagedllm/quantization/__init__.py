"""Quantized checkpoints: one module per format in formats/ (config parsing, checkpoint tensors,
the linear method), the CPU / GPU kernels in kernels/, writing checkpoints in algorithms/;
docs/quantization.md has the formats, knobs and what is exact. Which format a checkpoint has is
config_detection.py.

This package's `__init__` imports nothing: every layer imports quantization modules, and an
eager import of all formats here would run before any of them (an import circle through
layers/linear.py).
"""
