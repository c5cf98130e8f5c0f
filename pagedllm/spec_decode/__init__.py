"""Speculative decoding (docs/speculative_decoding.md): proposals checked by the target model
in one forward over the paged KV cache, accepted by rejection sampling."""
