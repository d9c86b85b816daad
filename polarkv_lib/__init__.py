"""PolarKV: a shared, tiered KV-cache service for LLM inference."""

__version__ = "0.1.0"
