"""What the endpoints share (`ServerState`: settings, the engine behind its owner thread, metrics, media resolver) and
the engine a server builds from its settings when it is given none (`build_engine`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..engine.config import EngineConfig
from ..engine.detokenize import byte_level_vocab
from ..engine.engine import Engine
from .async_engine import AsyncEngine
from .media_urls import MediaResolver
from .metrics import ServingMetrics
from .settings import ServerSettings

log = logging.getLogger("prism.server")


class ServerState:
    """What the endpoints share: settings, the engine behind its owner thread, metrics, media resolver."""

    def __init__(self, settings: ServerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.async_engine = AsyncEngine(
            engine, max_in_flight=settings.max_waiting_requests, preprocess_workers=settings.preprocess_workers
        )
        self.metrics = ServingMetrics(engine)
        # The lower of the server's and the engine's pixel budgets, so that the resolver refuses first.
        self.resolver = MediaResolver(
            settings, max_image_pixels=min(settings.max_image_pixels, engine.inputs.max_image_pixels),
            max_video_pixels=min(settings.max_video_pixels, engine.inputs.max_video_pixels))
        self.token_bytes = byte_level_vocab(engine.inputs.tokenizer)
        self.created = int(time.time())


def build_engine(settings: ServerSettings) -> Engine:
    config = EngineConfig.from_json(settings.engine_config_path) if settings.engine_config_path else EngineConfig()
    if settings.model_dir is None:
        from ..testing.checkpoints import ensure_tiny_checkpoint

        model_dir = ensure_tiny_checkpoint()
        log.warning("PRISM_MODEL is not set: serving the embedded tiny random-weight checkpoint at %s "
                    "(its answers are noise; set PRISM_MODEL to a Qwen3-VL directory)", model_dir)
    else:
        model_dir = Path(settings.model_dir)
    return Engine(model_dir, config)
