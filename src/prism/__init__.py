"""Prism: a Qwen3-VL inference engine that reuses the KV of shared image prefixes across requests."""

__version__ = "0.1.0"
