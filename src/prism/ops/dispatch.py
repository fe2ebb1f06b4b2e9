"""The dispatch rule every kernel op follows: Triton on CUDA, the torch reference elsewhere unless forced.

`PRISM_KERNELS` overrides the per-device default (never an explicit `use_triton`): `triton` runs the kernels
on the CPU too, under the Triton interpreter (so the engine's GPU code path can be tested on a CPU machine),
`reference` runs the torch references on CUDA too, `auto` (or unset) decides by device.
"""

from __future__ import annotations

import os

import torch

KERNELS_ENV = "PRISM_KERNELS"
_CHOICES = ("auto", "triton", "reference")


def kernels_override() -> str:
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected one of {_CHOICES}")
    return value


def want_triton(device: torch.device, use_triton: bool | None, *, have_triton: bool, interpreted: bool) -> bool:
    """True to launch the Triton kernel. `use_triton`: None = decide by device (or `PRISM_KERNELS`), False =
    reference, True = force (an error if Triton is missing, or if the tensors are on the CPU without the
    interpreter)."""
    if use_triton is None:
        override = kernels_override()
        if override == "reference":
            return False
        if override == "triton":
            use_triton = True
    if use_triton is False:
        return False
    if use_triton is None and device.type != "cuda":
        return False
    if not have_triton:
        raise RuntimeError("Triton is not installed (install prism[kernels]); pass use_triton=False to use the "
                           "torch reference")
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"Triton kernels need CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before "
                         "prism.ops is imported")
    return True
