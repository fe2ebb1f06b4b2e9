"""Kernels compiled for Hopper without a GPU (prism.testing.offline_compile) and `bench/kernel_resources.py`, which
reads the decode step's kernels with it. Compiled in child processes: the tests run under the Triton interpreter,
which compiles nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism.ops import kv_write
from prism.testing.offline_compile import run_outside_interpreter

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not kv_write.HAVE_TRITON, reason="needs Triton")

CHECKS = r'''
import json
import triton
import triton.language as tl
from prism.testing.offline_compile import compile_for_hopper, ptxas_resources


@triton.jit
def small(x_ptr, y_ptr, D, BLOCK: tl.constexpr):
    d = tl.arange(0, BLOCK)
    tl.store(y_ptr + d, tl.load(x_ptr + d, mask=d < D, other=0.0) * 2.0, mask=d < D)


@triton.jit
def planted_spills(x_ptr, y_ptr, BLOCK: tl.constexpr):
    # one warp holding a 256 x 256 fp32 tile (2,048 values a thread) and a transposed copy of it: far past 255
    # registers
    i = tl.arange(0, BLOCK)
    a = tl.load(x_ptr + i[:, None] * BLOCK + i[None, :])
    b = tl.load(x_ptr + i[None, :] * BLOCK + i[:, None])
    tl.store(y_ptr + i[:, None] * BLOCK + i[None, :], a * b + tl.sum(a, axis=0)[None, :])


args = {"x_ptr": "*fp32", "y_ptr": "*fp32", "D": "i32"}
out = {}
for name, marked in (("small", ()), ("small, D a multiple of 16", ("D",))):
    ptx = compile_for_hopper(small, args, {"BLOCK": 1024}, multiples_of_16=marked).asm["ptx"]
    out[name] = {**ptxas_resources(ptx), "vector_loads": ptx.count("ld.global.v4")}
ptx = compile_for_hopper(planted_spills, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {"BLOCK": 256}, num_warps=1).asm["ptx"]
out["planted spills"] = ptxas_resources(ptx)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def resources(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("offline")
    script = tmp / "checks.py"  # @triton.jit needs a source file
    script.write_text(CHECKS)
    done = run_outside_interpreter([str(script)], tmp)
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip(f"cannot compile for sm_90 here: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ptxas_resources_sees_registers_and_spills(resources):
    small = resources["small"]
    assert 0 < small["registers"] <= 255 and small["spill_store_bytes"] == 0 and small["stack_bytes"] == 0
    planted = resources["planted spills"]
    assert planted["registers"] > 0 and planted["spill_store_bytes"] > 0 and planted["spill_load_bytes"] > 0, planted


def test_an_argument_marked_as_a_multiple_of_16_is_specialized_on(resources):
    """As a launch does for an integer argument whose value is a multiple of 16: the masked loads, known to cover
    whole 16-element groups, become vector loads."""
    assert resources["small, D a multiple of 16"]["vector_loads"] > resources["small"]["vector_loads"], resources


def test_kernel_resources_reads_every_kernel_of_the_decode_step(tmp_path):
    """The bench tool compiles each of its rows (it names the kernels' arguments: a signature that drifted from a
    kernel's fails here, not in a GPU session) and reports registers for each."""
    done = run_outside_interpreter([str(ROOT / "bench" / "kernel_resources.py")], tmp_path)
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip(f"cannot compile for sm_90 here: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| kernel")]
    assert len(rows) == 13, done.stdout  # (the narrow band's GEMM and its split sums among them)
    for row in rows:
        registers = int(row.split("|")[3])
        assert 0 < registers <= 255, row
