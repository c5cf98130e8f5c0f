"""Command-line tools over the engine (kv_map: the KV block map as a PNG)."""
