"""Benchmarks: each script prints its figures and ends with one JSON line."""
