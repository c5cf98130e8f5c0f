"""Texts shipped with pagedllm: calibration.txt (quantization calibration) and heldout.txt (perplexity)."""
