"""Benchmarks users run: `loraplex bench` (offline text generation against transformers + PEFT) and the
workloads shared with benchmarks/bench_serving.py."""
