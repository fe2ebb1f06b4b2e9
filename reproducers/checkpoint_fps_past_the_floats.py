"""Found in session 37: a checkpoint whose `video_preprocessor_config.json` says `fps` is Infinity (the rate every video
is sampled at) started an engine that refused every video ("target fps must be a positive finite number, got inf");
one whose `fps` is 1e300 started too, and refused a video of 256 frames taken 11.6 days apart (2.56e8 seconds of
frames: 2.56e308 frames to sample, past the floats) as "video_fps=1e-06 is too small", blaming the request. Fixed when a
config's fps is checked as a request's rates are (a positive finite number), and at most the rate at which every
video whose timestamps fit still has a float's count of frames to sample: a `MediaConfigError` naming the file and the
value, raised as the engine starts, before its model is loaded."""

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

wrong = []
for fps, shown in ((float("inf"), "inf"), (1e300, "1e+300")):
    loaded.clear()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        shutil.copytree(ensure_tiny_checkpoint(), checkpoint)
        config_file = checkpoint / "video_preprocessor_config.json"
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"fps": fps}))
        try:
            LLM(checkpoint)
        except MediaConfigError as error:
            if not (shown in str(error) and str(config_file) in str(error)) or loaded:
                wrong.append(f"fps={shown}: a MediaConfigError {'after' if loaded else 'before'} the model loaded: "
                             f"{error}")
            continue
        except Exception as error:  # noqa: BLE001 - whatever else it raised
            wrong.append(f"fps={shown}: {type(error).__name__}: {error}")
            continue
        wrong.append(f"fps={shown}: the engine started")
_common.verdict(not wrong, "a checkpoint's fps of inf or 1e300 is a MediaConfigError naming the file and the value, "
                "before the model loads", "; ".join(wrong))
