"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU, and read what the compiler made of it.

Owns nothing of the engine: it serves the checks of what a kernel *emits* (`tests/test_pdl.py`: the PTX's order of
`griddepcontrol.wait` and the first memory access) and `bench/kernel_resources.py` (registers, spills and shared
memory per kernel, from the `ptxas` that ships inside the Triton wheel). Must run outside the Triton interpreter
(`TRITON_INTERPRET` unset): the interpreter compiles nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

# Pointers, strides, K (a GEMM's inner size) and a split GEMM's K share are 16-byte aligned / multiples of 16 in
# every real launch, which Triton specializes on: without these attributes the compiled kernel has no asynchronous
# copies, and it is not the kernel the GPU runs.
ALIGNED_ARGUMENTS = ("K", "K_PER_SPLIT")


def compile_for_hopper(kernel, signature: dict, constexprs: dict, *, num_warps: int = 4, launch_pdl: bool = True,
                       multiples_of_16: tuple[str, ...] = ()):
    """`kernel` (a `triton.jit` function) compiled for sm_90: `signature` maps each runtime argument to its Triton
    type ("*bf16", "i32", "fp32", ...), `constexprs` each constexpr argument to its value; `multiples_of_16` names
    the integer arguments (besides strides and K) whose launch values are multiples of 16, which a real launch
    specializes on too. Arguments a kernel declares `do_not_specialize` are never marked, as the JIT never marks
    them. The JIT's other rule is the caller's to mirror: an integer argument equal to 1 at launch is compiled as a
    constant, so pass it in `constexprs`. Returns Triton's compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`,
    `.metadata.shared`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {**signature, **{name: "constexpr" for name in constexprs}}
    unspecialized = {p.name for p in kernel.params if p.do_not_specialize}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if name in signature and name not in unspecialized
               and (signature[name].startswith("*") or name.startswith("stride") or name in ALIGNED_ARGUMENTS
                    or name in multiples_of_16)}
    source = ASTSource(fn=kernel, signature=full, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "launch_pdl": launch_pdl})


def compile_error(kernel, signature: dict, constexprs: dict, **options) -> str | None:
    """None if `compile_for_hopper` compiles the kernel, else the compiler's error, whatever its type, shortened
    (for reproducers of kernels that did not compile)."""
    try:
        compile_for_hopper(kernel, signature, constexprs, **options)
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[-300:]}"
    return None


def run_outside_interpreter(args: list[str], cwd: str | os.PathLike, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`python *args` in a child process with `TRITON_INTERPRET` unset (the tests run under the interpreter, which
    compiles nothing) and this package importable; its output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s,
                          cwd=cwd)


def ptxas_path() -> str:
    """The `ptxas` inside the Triton wheel (what Triton itself assembles with); FileNotFoundError if absent."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no ptxas at {path}")
    return path


_RESOURCE_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}


def ptxas_resources(ptx: str, arch: str = "sm_90a") -> dict[str, int]:
    """What `ptxas -v` reports for the single kernel of `ptx`: registers per thread, stack frame, spill stores and
    loads in bytes per thread. RuntimeError if the report lacks any of them, or holds more than one function."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas_path(), f"-arch={arch}", "-v", src, "-o", out], capture_output=True,
                              text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed: {done.stderr[-2000:]}")
    report = done.stderr + done.stdout
    found = {}
    for key, pattern in _RESOURCE_PATTERNS.items():
        matches = re.findall(pattern, report)
        if len(matches) != 1:
            raise RuntimeError(f"ptxas -v: {len(matches)} matches of {pattern!r} (one kernel expected):\n{report}")
        found[key] = int(matches[0])
    return found
