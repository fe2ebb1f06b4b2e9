"""Config values that passed the engine's checks and broke its start: `encoder_cache_bytes=-1` failed after the model
had loaded with a `MediaError` about "max_bytes"; `device="cuda:7"` (on a machine without it) and `device="x"` failed
inside the model's loading with torch's errors; `model_id=True` with an `InputError`; `num_cpu_pages=True` in the
KV layout; `distributed_timeout_s=inf` was accepted. Fixed when each is a `ConfigError` naming its key, raised before
the model is loaded (`EngineConfig.__post_init__`, `rank.check_rank_devices`)."""

import math

import _common

from prism.engine import rank  # noqa: E402
from prism.engine.config import ConfigError  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

loaded = []
load_model = rank.load_model
rank.load_model = lambda *a, **kw: loaded.append(1) or load_model(*a, **kw)

wrong = {}
for key, value in [("encoder_cache_bytes", -1), ("preprocess_cache_bytes", "1"), ("device", "x"),
                   ("device", "cuda:7"), ("model_id", True), ("num_cpu_pages", True),
                   ("distributed_timeout_s", math.inf)]:
    loaded.clear()
    try:
        LLM(ensure_tiny_checkpoint(), **{key: value})
        wrong[f"{key}={value!r}"] = "accepted"
    except ConfigError as error:
        if key not in str(error) or loaded:
            wrong[f"{key}={value!r}"] = f"ConfigError {'after loading' if loaded else 'not naming it'}: {error}"
    except Exception as error:
        wrong[f"{key}={value!r}"] = f"{type(error).__name__} {'after loading' if loaded else ''}: {error}"
_common.verdict(not wrong, "each bad value is a ConfigError naming its key, before the model is loaded",
                f"{len(wrong)} value(s) not refused so: {wrong}")
