"""Found in session 36: a checkpoint whose `video_preprocessor_config.json` says `num_frames=10**9` (the frame count
every video is sampled to; `max_frames` is 768) started an engine, which then refused every video with "num_frames=
1000000000 is more frames than this model's video processor samples a video to", blaming a count the request never
gave (HF would sample 10**9 frames). Fixed when such a config is a `MediaConfigError` naming the file, the value and
`max_frames`, raised as the engine starts, before its model is loaded."""

import json
import shutil
import tempfile
from pathlib import Path

import _common

from prism.engine import rank  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.media.errors import MediaConfigError  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

loaded = []
load_model = rank.load_model
rank.load_model = lambda *a, **kw: loaded.append(1) or load_model(*a, **kw)

with tempfile.TemporaryDirectory() as tmp:
    checkpoint = Path(tmp) / "checkpoint"
    shutil.copytree(ensure_tiny_checkpoint(), checkpoint)
    config_file = checkpoint / "video_preprocessor_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"num_frames": 10**9}))
    try:
        LLM(checkpoint)
        outcome, ok = "the engine started", False
    except MediaConfigError as error:
        named = all(word in str(error) for word in ("num_frames=1000000000", "max_frames=768", config_file.name))
        outcome = f"a MediaConfigError {'after' if loaded else 'before'} the model loaded: {error}"
        ok = named and not loaded
    except Exception as error:  # noqa: BLE001 - whatever else it raised
        outcome, ok = f"{type(error).__name__}: {error}", False
_common.verdict(ok, outcome, f"a checkpoint with num_frames=10**9: {outcome}")
