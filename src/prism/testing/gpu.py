"""GPU test helpers: give back the memory of engines that are no longer referenced; watch the models engines load (a
failed start must let go of its model, on any device); see which Triton kernel variants a process launches for the
first time (the GPU tests' no-compile-after-start check, `bench/profile_w4.py`'s timeline)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable

import torch


def release_gpu_memory() -> None:
    """Collect unreachable engines (reference cycles keep them alive past `del`), then return the cached
    blocks to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def watch_loaded_models(monkeypatch) -> list[weakref.ref]:
    """Weak references to every model the engines load from now on (`rank.load_model`, until `monkeypatch` undoes)."""
    from ..engine import rank

    refs: list[weakref.ref] = []
    load = rank.load_model

    def recorded(*args, **kwargs):
        model = load(*args, **kwargs)
        refs.append(weakref.ref(model))
        return model

    monkeypatch.setattr(rank, "load_model", recorded)
    return refs


def record_first_launches(record: Callable[[str, float], None]) -> Callable[[], None]:
    """Until the returned function is called: `record(kernel name, host ms)` for each Triton kernel variant launched
    for the first time in this process (`JITFunction._do_compile`: a compile, or a load from Triton's disk cache; a
    variant already launched does not reach it). Not under the interpreter, whose kernels never compile."""
    from triton.runtime.jit import JITFunction

    compile_ = JITFunction._do_compile

    def counted(fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return compile_(fn, *args, **kwargs)
        finally:
            record(fn.fn.__name__, (time.perf_counter() - start) * 1e3)

    JITFunction._do_compile = counted

    def restore() -> None:
        JITFunction._do_compile = compile_

    return restore
