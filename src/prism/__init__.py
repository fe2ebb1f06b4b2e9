"""Prism: a Qwen3-VL inference engine that reuses the KV of shared image prefixes across requests.

`prism.LLM(model_dir, **config)` is the offline API; `prism.Engine` the step-level one.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that `import prism` stays cheap (no torch/model import until the engine is used).
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "Engine":
        from .engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from .engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'prism' has no attribute {name!r}")
