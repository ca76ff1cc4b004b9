"""Benchmarks that print numbers side by side with a baseline measured in the same run."""
