"""Benchmarks, profiling and demo-model tooling."""
