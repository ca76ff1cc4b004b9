"""Fuzzing a live node with hostile control frames (issue 15): generator, harness, report."""
