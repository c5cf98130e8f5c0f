"""Multi-LoRA serving (issue 27): batches that mix tokens of several adapters and of the base
model, each layer's LoRA product computed by one kernel call per op (ops.py) indexed by a
per-token adapter slot."""
