"""`prism.testing.gpu.record_first_launches`, which the GPU tests' no-compile-after-start check and `profile_w4.py`
rely on: each first launch of a kernel variant is reported by name, a failed one too, and the hook comes off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

from triton.runtime.jit import JITFunction  # noqa: E402

from prism.testing.gpu import record_first_launches  # noqa: E402


def test_each_first_launch_is_reported_and_the_hook_comes_off(monkeypatch):
    compiled = []

    def compile_(fn, *args, **kwargs):  # Triton's own compile, which a CPU test cannot run for a GPU
        if kwargs.get("fail"):
            raise RuntimeError("ptxas failed")
        compiled.append((fn.fn.__name__, args))
        return "kernel"

    monkeypatch.setattr(JITFunction, "_do_compile", compile_)
    seen = []
    stop = record_first_launches(lambda name, ms: seen.append((name, ms)))
    assert JITFunction._do_compile is not compile_
    kernel = SimpleNamespace(fn=SimpleNamespace(__name__="_decode_kernel"))
    assert JITFunction._do_compile(kernel, 1, 2) == "kernel"
    with pytest.raises(RuntimeError, match="ptxas"):
        JITFunction._do_compile(SimpleNamespace(fn=SimpleNamespace(__name__="_broken_kernel")), fail=True)
    stop()
    assert JITFunction._do_compile is compile_
    JITFunction._do_compile(kernel)  # not recorded any more
    assert [name for name, _ in seen] == ["_decode_kernel", "_broken_kernel"]
    assert all(ms >= 0 for _, ms in seen)
    assert compiled == [("_decode_kernel", (1, 2)), ("_decode_kernel", ())]
