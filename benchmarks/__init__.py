"""Throughput / memory benchmarks; each writes a JSON + Markdown report under benchmarks/results/."""
