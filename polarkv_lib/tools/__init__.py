"""Operator tools: benchmarks and (later) replay and planning."""
