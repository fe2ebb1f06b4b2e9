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
        # The lower of the server's and the engine's pixel budgets, and the engine's video sampling, so that the
        # resolver refuses first.
        self.resolver = MediaResolver(
            settings, max_image_pixels=min(settings.max_image_pixels, engine.inputs.max_image_pixels),
            max_video_pixels=min(settings.max_video_pixels, engine.inputs.max_video_pixels),
            video_config=engine.inputs.video_config)
        self.token_bytes = byte_level_vocab(engine.inputs.tokenizer)
        self.created = int(time.time())


# The engine config's fields that the server's own settings (its environment variables) set too.
PIXEL_BUDGETS = ("max_image_pixels", "max_video_pixels")


def engine_config_of(settings: ServerSettings) -> EngineConfig:
    """The config of the engine a server builds: `PRISM_CONFIG`'s file (or the defaults), with the server's pixel
    budgets (`PRISM_MAX_IMAGE_PIXELS`, `PRISM_MAX_VIDEO_PIXELS`) as the engine's too wherever the file names none, so
    that raising a variable raises the limit; a budget the file names stays the file's (the server then refuses at the
    lower of the two, `ServerState`)."""
    named = EngineConfig.read_json(settings.engine_config_path) if settings.engine_config_path else {}
    budgets = {name: getattr(settings, name) for name in PIXEL_BUDGETS if name not in named}
    return EngineConfig.from_dict({**named, **budgets})


def build_engine(settings: ServerSettings) -> Engine:
    config = engine_config_of(settings)
    if settings.model_dir is None:
        from ..testing.checkpoints import ensure_tiny_checkpoint

        model_dir = ensure_tiny_checkpoint()
        log.warning("PRISM_MODEL is not set: serving the embedded tiny random-weight checkpoint at %s "
                    "(its answers are noise; set PRISM_MODEL to a Qwen3-VL directory)", model_dir)
    else:
        model_dir = Path(settings.model_dir)
    return Engine(model_dir, config)
