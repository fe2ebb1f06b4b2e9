"""The dispatch rule every paged op follows: Triton on CUDA, the torch reference elsewhere unless forced."""

from __future__ import annotations

import torch


def want_triton(device: torch.device, use_triton: bool | None, *, have_triton: bool, interpreted: bool) -> bool:
    """True to launch the Triton kernel. `use_triton`: None = decide by device, False = reference, True = force
    (an error if Triton is missing, or if the tensors are on the CPU without the interpreter)."""
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
