"""Benchmarks (BENCHMARKS.md): figures as ratios against a peer measured in the same run."""
