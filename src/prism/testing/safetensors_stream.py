"""Streaming safetensors writer: one tensor in memory at a time, byte-deterministic output.

Owns: the on-disk layout of generated checkpoints (header order = the given tensor order, header
padded with spaces to 8 bytes, `{"format": "pt"}` metadata), which the `safetensors` library and HF
read back. Writing tensor by tensor is what lets an 8B checkpoint be built without 2x memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(
    path: Path,
    entries: Sequence[TensorEntry],
    produce: Callable[[TensorEntry], torch.Tensor],
) -> int:
    """Write `entries` to `path`, calling `produce(entry)` for each tensor in order; return data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{e.name}: unsupported dtype {e.dtype}")
        header[e.name] = {
            "dtype": _DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            t = produce(e)
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ValueError(
                    f"{e.name}: produced {tuple(t.shape)} {t.dtype}, declared {e.shape} {e.dtype}"
                )
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            del t, data  # free this tensor before the next one is produced
    return offset
