"""LLMEngine and its request state."""
