"""ops/host_copy.py: the staging copy for the device is one single-threaded memcpy over the bytes, any dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prism.ops import host_copy
from prism.ops.host_copy import concatenated_on, copy_bytes, copy_into, staged_in_pinned_memory, to_device
from prism.testing.host_reads import host_copies

DTYPES = [torch.uint8, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_bytes_copies_every_dtype_bitwise(dtype):
    src = (torch.randn(3, 5, 7) * 20).to(dtype)
    dst = torch.empty_like(src)
    copy_bytes(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_copy_bytes_refuses_what_a_memcpy_would_get_wrong():
    x = torch.zeros(4, 6)
    for dst, src in ((torch.zeros(4, 6, dtype=torch.float64), x), (torch.zeros(6, 4), x), (torch.zeros(6, 4).t(), x)):
        with pytest.raises(ValueError, match="contiguous tensors of one dtype and shape"):
            copy_bytes(dst, src)
    copy_bytes(torch.empty(0, 3), torch.empty(0, 3))  # nothing to copy is fine


def test_staging_is_a_new_contiguous_copy_made_without_a_torch_copy():
    frame = torch.randint(0, 256, (448, 448, 3), dtype=torch.uint8)  # one W1 image's frame
    assert host_copies(lambda: staged_in_pinned_memory(frame, pin=False)) == []
    staged = staged_in_pinned_memory(frame, pin=False)
    assert torch.equal(staged, frame) and staged.data_ptr() != frame.data_ptr()
    strided = frame.permute(2, 0, 1)
    assert torch.equal(staged_in_pinned_memory(strided, pin=False), strided)


def test_the_staging_check_sees_a_torch_copy(monkeypatch):
    """Planted: the staging copy through torch (as `Tensor.pin_memory()` does it) is reported."""
    monkeypatch.setattr(host_copy, "copy_bytes", lambda dst, src: dst.copy_(src))
    frame = torch.randint(0, 256, (448, 448, 3), dtype=torch.uint8)
    assert host_copies(lambda: staged_in_pinned_memory(frame, pin=False)) == ["aten.copy_.default"]


def test_to_device_takes_lists_arrays_and_tensors():
    assert torch.equal(to_device([1, 2, 3], "cpu", torch.int64), torch.tensor([1, 2, 3]))
    assert to_device(np.arange(4, dtype=np.int32), "cpu").dtype == torch.int32
    assert to_device(torch.ones(2), "cpu", torch.float16).dtype == torch.float16


def test_concatenated_on_joins_the_bytes_of_every_tensor_in_order():
    parts = [torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8), torch.randn(4).to(torch.bfloat16),
             torch.randint(0, 256, (2, 3), dtype=torch.uint8).t(), torch.empty(0, dtype=torch.uint8)]
    joined = concatenated_on(parts, "cpu")
    want = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])
    assert joined.dtype == torch.uint8 and torch.equal(joined, want)


def test_lazily_conjugated_and_negated_tensors_are_staged_as_their_values():
    z = torch.randn(3, 4, dtype=torch.complex64)
    assert torch.equal(staged_in_pinned_memory(z.conj(), pin=False), z.conj().resolve_conj())
    assert torch.equal(concatenated_on([z.conj()], "cpu").view(torch.complex64), z.conj().resolve_conj().flatten())
    with pytest.raises(ValueError, match="host tensors"):
        concatenated_on([torch.zeros(2, device="meta")], "cpu")


def test_copy_into_fills_a_host_buffer_slice_from_an_array_or_a_tensor():
    buffer = torch.zeros(3, 8, dtype=torch.int64)
    copy_into(buffer[:, :4], np.arange(12, dtype=np.int64).reshape(3, 4))
    copy_into(buffer[:, 4:], torch.full((3, 4), 7, dtype=torch.int64))
    assert torch.equal(buffer[:, :4], torch.arange(12).view(3, 4)) and bool((buffer[:, 4:] == 7).all())
