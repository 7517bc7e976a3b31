"""`python -m sglang.bench_serving`'s parts: datasets, request backends, metrics."""
