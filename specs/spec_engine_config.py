"""Spec of the engine's configuration on the real engine (tiny checkpoint, CPU).

Invariant: a configuration value is refused before the model is loaded, by a `ConfigError` (or, for the KV pool's
size, which needs the model's shape, a `KVCapacityError`) whose message names the key at fault; a value that is not
refused gives an engine that starts and serves a request to its end. Found by this spec (session 29): the cache
sizes, `device` and `model_id` were not checked, so `encoder_cache_bytes=-1` failed after the model had loaded with a
`MediaError` about "max_bytes", `device="cuda"` on a machine without one failed inside the model's loading, and
`distributed_timeout_s=inf` was accepted (no collective can be bounded by it).

Domain: one key at a time, every key but `tensor_parallel_size` (it spawns processes; `tests/test_tp*.py`), values of
every JSON kind, integers small enough that an accepted pool fits in this machine's memory (off CUDA, where there is
no free-memory query, a pool too large for the host fails in torch's allocator, with torch's message; on CUDA it is a
`KVCapacityError` naming the key, `specs/spec_kv_pool_memory.py`).
"""

from __future__ import annotations

import dataclasses
import math
import sys

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prism.distributed.capacity import KVCapacityError
from prism.engine.config import ConfigError, EngineConfig
from prism.engine.llm import LLM
from prism.engine.request import FinishReason
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

KEYS = sorted(f.name for f in dataclasses.fields(EngineConfig) if f.name != "tensor_parallel_size")

# Values a JSON config can hold: the right kind and the wrong one, in range and out of it, and the values the keys
# mean (names of devices, dtypes, preemption modes).
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(-5000, 5000),
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.5, 1.0, 1e-9, 2.5e3]),
    st.text(max_size=6),
    st.sampled_from(["auto", "cpu", "cuda", "cuda:0", "cuda:7", "meta", "fp8", "bf16", "float16", "bfloat16",
                     "swap", "recompute", "1", "true"]),
    st.just([]), st.just({}),
)


NAMES = ["auto", "cpu", "cuda", "fp8", "bf16", "fp16", "fp32", "float32", "bfloat16", "swap", "recompute", "m"]


def plausible_values(key: str) -> st.SearchStrategy:
    """Values of the key's own kind, mostly in range (two examples in three), so that accepted configs are served."""
    default = {f.name: f.default for f in dataclasses.fields(EngineConfig)}[key]
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int) or default is None:
        return st.one_of(st.integers(1, 300), st.integers(1, 300), st.just(0), st.none())
    if isinstance(default, float):
        return st.floats(0, 10)
    return st.sampled_from(NAMES)


def examples_of(pairs):
    """Hypothesis `@example`s, one per (key, value)."""
    def decorate(spec):
        for pair in reversed(pairs):
            spec = example(key_value=pair)(spec)
        return spec
    return decorate


def names_the_key(error: Exception, key: str) -> bool:
    return key in str(error)


def serves_one_request(llm: LLM) -> None:
    """A one-token prompt and one generated token: within any pool the engine accepted (max_model_len >= 2)."""
    out = llm.generate(["a"], SamplingParams.greedy(max_tokens=1, ignore_eos=True))
    assert len(out) == 1 and len(out[0].token_ids) == 1, out
    assert out[0].finish_reason == FinishReason.LENGTH, out[0].finish_reason


@st.composite
def key_values(draw: st.DrawFn) -> tuple[str, object]:
    key = draw(st.sampled_from(KEYS))
    return key, draw(st.one_of(VALUES, plausible_values(key), plausible_values(key)), label=key)


# The values this spec found passing the checks (session 29), kept as directed examples.
FOUND = [("device", "x"), ("device", "cuda:7"), ("encoder_cache_bytes", -1), ("preprocess_cache_bytes", "1"),
         ("model_id", True), ("num_cpu_pages", True), ("distributed_timeout_s", math.inf)]


@settings(max_examples=80, deadline=None)
@given(key_value=key_values())
@examples_of(FOUND)
def spec_a_config_value_is_refused_naming_its_key_or_serves(key_value: tuple[str, object]) -> None:
    key, value = key_value
    switch_interval = sys.getswitchinterval()  # `python_switch_interval_ms` sets it for the process
    try:
        try:
            config = EngineConfig.from_dict({key: value})
        except ConfigError as error:
            assert names_the_key(error, key), f"{key}={value!r} refused without naming it: {error}"
            return
        try:
            llm = LLM(ensure_tiny_checkpoint(), **{key: value})
        except (ConfigError, KVCapacityError) as error:
            assert names_the_key(error, key), f"{key}={value!r} refused at the start without naming it: {error}"
            return
        except Exception as error:  # the spec's failure: a value that passed the checks broke the engine
            raise AssertionError(f"{key}={value!r} passed the config checks ({config}) but the engine failed to "
                                 f"start: {type(error).__name__}: {error}") from error
        try:
            serves_one_request(llm)
        finally:
            llm.engine.shutdown()
    finally:
        sys.setswitchinterval(switch_interval)
