"""`uvicorn src.prism.server:app` (or `prism.server:app`): the OpenAI-compatible server.

Configured from the environment (see `prism.serving.settings.ServerSettings`): PRISM_MODEL is a HF Qwen3-VL
directory (unset: an embedded tiny random checkpoint, built once into a cache directory), PRISM_CONFIG an
engine JSON (see configs/).
"""

from .serving.app import create_app

app = create_app()
