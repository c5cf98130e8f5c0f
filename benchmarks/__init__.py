"""Benchmarks: fixed seeded workloads and backends (pagedllm, transformers)."""
