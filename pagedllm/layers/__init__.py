"""Model building blocks: linear layers, norms, activations, rotary embedding, paged attention.

Import each from its module (`pagedllm.layers.linear`, ...): the package re-exports nothing, so
importing one block never imports the others (quantization.formats.base and layers.linear need
each other's neighbours).
"""
