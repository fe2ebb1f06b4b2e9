"""Programmatic dependent launch (PDL) of the decode step's kernels, in the captured CUDA graphs and eager steps.

Owns the one rule that makes an early launch safe: a kernel launched with `launch_pdl` may start while the kernel
before it still runs, so it calls `wait_for_predecessors` (`griddepcontrol.wait`: every earlier grid has finished
and its writes are visible) before it reads or writes any memory (before it, only address arithmetic). The same
call lets the next kernel launch (`launch_dependents`, before the wait: `TRIGGER_FIRST`), so that kernel's blocks
are resident and waiting when this one ends, instead of being launched after it. `tests/test_pdl.py` checks the
rule on the source of every kernel so launched, and on the PTX for Hopper of the main ones (the wait before the
first memory access).

Why: at decode batch 1 a step of the 8B model is ~260-330 small kernels (7-9 per layer) in a graph, and each boundary
costs the launch and the ramp of the next kernel (W3: 4.6 ms against 3.6 of weight reads). On the H200 an early
launch saves 1.2-2.1 us per norm + GEMV pair (`bench/decode_gemms.py --chain`), W3 batch 1 4.51 -> 4.43 ms. A
kernel without the wait must not be launched this way; a kernel launched normally after one of these waits for it
entirely, as ever.

Scope: `programmatic_launch(True)` around a runner's start, captures and steps (`ModelRunner`, `programmatic_launch`
in `EngineConfig`), so the captured and the eager steps use one compiled variant; the kernels read
`launch_options(device)`. Off on the CPU (the interpreter has no `griddepcontrol`), before Hopper, and outside the context.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from .kv_write import _INTERPRETED, HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("prism_programmatic_launch", default=False)
# Where a kernel lets the next one launch: before its wait (True), so that the kernels after it are resident,
# waiting, as soon as the GPU has room for them, not one at a time; or after it (False). Safe either way: each kernel
# still waits for the one before it, which waited for its own predecessor; and a kernel's dependents launch only
# once every block of it has started, so waiting blocks never hold an SM a running kernel still needs. H200, W3
# batch 1 (session 17, one machine): 4.26 -> 4.23 ms.
TRIGGER_FIRST = True


@contextlib.contextmanager
def programmatic_launch(enabled: bool):
    """Within: the decode kernels launched on a Hopper-or-later GPU are launched with PDL (when `enabled`)."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The keyword arguments of a PDL-aware kernel's launch: its `PDL` constexpr, and Triton's `launch_pdl` when
    set."""
    if (_ENABLED.get() and not _INTERPRETED and device.type == "cuda"
            and _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())):
        return {"PDL": 2 if TRIGGER_FIRST else True, "launch_pdl": True}
    return {"PDL": False}


if HAVE_TRITON:

    @triton.jit
    def wait_for_predecessors(PDL: tl.constexpr):
        """The first statement of every kernel `launch_options` may launch early (see the module docstring)."""
        if PDL == 2:  # TRIGGER_FIRST
            gdc_launch_dependents()
            gdc_wait()
        elif PDL:
            gdc_wait()
            gdc_launch_dependents()
