"""Image inputs (docs/multimodal.md): the request side (features, processing, media loading)."""
