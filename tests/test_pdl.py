"""Programmatic dependent launch (`prism.ops.pdl`): when the decode kernels are launched early, and the rule that
makes it safe, checked on the source of every kernel so launched.

The rule: a kernel launched with `**launch_options(...)` may start before its predecessor ends, so before its
`wait_for_predecessors(PDL)` it does nothing but address arithmetic. The check reads `src/prism/ops` (the real kernels, not a copy), and a
planted kernel that reads before it waits, or forgets the wait, must be caught.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch

from prism.ops import pdl

SRC = Path(pdl.__file__).parents[1]  # src/prism: every module, not only ops/

# What a kernel may call before its wait: Triton builtins that compute indices and never touch memory, and `.to`.
ADDRESS_ARITHMETIC = {"program_id", "num_programs", "arange", "zeros", "full", "minimum", "maximum", "cdiv", "to",
                      "cast", "range", "min", "max"}


def _is_launch_options(keyword: ast.keyword) -> bool:
    value = keyword.value
    return (keyword.arg is None and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "launch_options")


def _launched_name(call: ast.Call) -> str | None:
    """`kernel` of a launch `kernel[grid](...)` or `module.kernel[grid](...)`."""
    if not isinstance(call.func, ast.Subscript):
        return None
    target = call.func.value
    return target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None


def early_launched_kernels(sources: dict[str, str]) -> set[str]:
    """Names of the kernels launched as `kernel[grid](..., **launch_options(...))` in these module sources."""
    names = set()
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and _launched_name(node) and any(map(_is_launch_options, node.keywords)):
                names.add(_launched_name(node))
    return names


def _is_wait(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and isinstance(statement.value.func, ast.Name) and statement.value.func.id == "wait_for_predecessors"
            and [a.id for a in statement.value.args if isinstance(a, ast.Name)] == ["PDL"])


def _may_break_the_rule(statement: ast.stmt) -> bool:
    """Whether a statement before the wait may touch memory or end the program before it waits: any call but
    index arithmetic (a load, a store, inline assembly, a helper that might), or a return."""
    for node in ast.walk(statement):
        if isinstance(node, ast.Return):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name not in ADDRESS_ARITHMETIC:
                return True
    return False


def _waits_first(fn: ast.FunctionDef) -> bool:
    """At the kernel's top level, `wait_for_predecessors(PDL)` comes before anything but address arithmetic."""
    for statement in fn.body:
        if _is_wait(statement):
            return True
        if _may_break_the_rule(statement):
            return False
    return False


def rule_violations(sources: dict[str, str]) -> list[str]:
    """Kernels launched early that touch memory before `wait_for_predecessors(PDL)` (or that are not found; every
    definition of a launched name is checked), kernels with a PDL parameter never launched with `launch_options`
    (their PDL would stay unset), and `launch_pdl` set anywhere but `launch_options`."""
    kernels: dict[str, list[ast.FunctionDef]] = {}
    problems = []
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                kernels.setdefault(node.name, []).append(node)
            if isinstance(node, ast.keyword) and node.arg == "launch_pdl":
                problems.append(f"{module}: launch_pdl set by hand (only launch_options may)")
    launched = early_launched_kernels(sources)
    problems += [f"{name}: launched early but not found" for name in sorted(launched - kernels.keys())]
    problems += [f"{name}: launched early but touches memory before wait_for_predecessors(PDL)"
                 for name in sorted(launched & kernels.keys()) if not all(map(_waits_first, kernels[name]))]
    with_pdl = {name for name, fns in kernels.items() for fn in fns if "PDL" in [a.arg for a in fn.args.args]
                and name != "wait_for_predecessors"}
    problems += [f"{name}: takes PDL but is never launched with launch_options" for name in sorted(with_pdl - launched)]
    return problems


def src_sources() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text() for p in sorted(SRC.rglob("*.py"))}


def test_every_kernel_launched_early_waits_for_its_predecessors_first():
    sources = src_sources()
    launched = early_launched_kernels(sources)
    # the decode step's chain, layer by layer (`model/text.py` at batch 1)
    assert {"_gemv_kernel", "_gemv_silu_and_mul_kernel", "_add_rms_norm_kernel", "_rms_norm_kernel",
            "_qk_norm_rope_write_kv_kernel", "_decode_kernel", "_decode_reduce_kernel"} <= launched, launched
    assert rule_violations(sources) == []


PLANTED = '''
@triton.jit
def _reads_then_waits(x_ptr, y_ptr, PDL: tl.constexpr):
    x = tl.load(x_ptr)
    wait_for_predecessors(PDL)
    tl.store(y_ptr, x)

@triton.jit
def _never_waits(x_ptr, PDL: tl.constexpr):
    tl.store(x_ptr, 1)

@triton.jit
def _waits_first(x_ptr, PDL: tl.constexpr):
    """A docstring is not a statement."""
    rows = tl.program_id(0) * 8 + tl.arange(0, 8)
    wait_for_predecessors(PDL)
    tl.store(x_ptr, 1)

@triton.jit
def _calls_a_helper_before_it_waits(x_ptr, PDL: tl.constexpr):
    if PDL:
        norm_rope_values(x_ptr)
    wait_for_predecessors(PDL)

@triton.jit
def _calls_a_module_helper_before_it_waits(x_ptr, PDL: tl.constexpr):
    offset = kv_write.slot_offset(x_ptr, 0, 0, 1, 1, tl.int64)
    wait_for_predecessors(PDL)

@triton.jit
def _inline_asm_before_it_waits(x_ptr, PDL: tl.constexpr):
    v = tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [x_ptr], dtype=tl.int32, is_pure=False, pack=1)
    wait_for_predecessors(PDL)

@triton.jit
def _returns_before_it_waits(x_ptr, n, PDL: tl.constexpr):
    if tl.program_id(0) >= n:
        return
    wait_for_predecessors(PDL)

@triton.jit
def _waits_inside_a_branch(x_ptr, PDL: tl.constexpr):
    if PDL:
        wait_for_predecessors(PDL)
    tl.store(x_ptr, 1)

def launch(x, dev):
    _reads_then_waits[(1,)](x, x, **launch_options(dev))
    _never_waits[(1,)](x, **launch_options(dev))
    _waits_first[(1,)](x, **launch_options(dev))
    _calls_a_helper_before_it_waits[(1,)](x, **launch_options(dev))
    other._calls_a_module_helper_before_it_waits[(1,)](x, **launch_options(dev))
    _inline_asm_before_it_waits[(1,)](x, **launch_options(dev))
    _returns_before_it_waits[(1,)](x, 1, **launch_options(dev))
    _waits_inside_a_branch[(1,)](x, **launch_options(dev))
'''

# A second module: a kernel of the same name that breaks the rule, and a launch setting launch_pdl by hand.
PLANTED_ELSEWHERE = '''
@triton.jit
def _waits_first(x_ptr, PDL: tl.constexpr):
    tl.store(x_ptr, 1)
    wait_for_predecessors(PDL)

def launch(x):
    _never_waits[(1,)](x, launch_pdl=True)
'''


def test_the_rule_check_catches_every_planted_violation():
    problems = rule_violations({"planted.py": textwrap.dedent(PLANTED)})
    broken = ["_calls_a_helper_before_it_waits", "_calls_a_module_helper_before_it_waits",
              "_inline_asm_before_it_waits", "_never_waits", "_reads_then_waits", "_returns_before_it_waits",
              "_waits_inside_a_branch"]
    assert problems == [f"{name}: launched early but touches memory before wait_for_predecessors(PDL)"
                        for name in broken]
    both = rule_violations({"planted.py": textwrap.dedent(PLANTED), "other.py": textwrap.dedent(PLANTED_ELSEWHERE)})
    assert "other.py: launch_pdl set by hand (only launch_options may)" in both
    assert "_waits_first: launched early but touches memory before wait_for_predecessors(PDL)" in both
    unlaunched = PLANTED.replace("    _waits_first[(1,)](x, **launch_options(dev))\n", "")
    assert "_waits_first: takes PDL but is never launched with launch_options" in rule_violations(
        {"planted.py": textwrap.dedent(unlaunched)})


def test_launch_options_are_off_outside_the_context_on_the_cpu_and_before_hopper(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    monkeypatch.setattr(pdl, "_supports_pdl", lambda index: True)
    assert pdl.launch_options(cuda) == {"PDL": False}, "off unless a runner asked for it"
    with pdl.programmatic_launch(True):
        assert pdl.launch_options(cuda) == {"PDL": 2, "launch_pdl": True}, "the next kernel let in before the wait"
        monkeypatch.setattr(pdl, "TRIGGER_FIRST", False)
        assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}, "... or after it"
        assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
        with pdl.programmatic_launch(False):  # a runner configured without it, inside another's context
            assert pdl.launch_options(cuda) == {"PDL": False}
        assert pdl.launch_options(cuda)["PDL"]
        monkeypatch.setattr(pdl, "_supports_pdl", lambda index: False)  # before Hopper: no griddepcontrol
        assert pdl.launch_options(cuda) == {"PDL": False}
        monkeypatch.setattr(pdl, "_supports_pdl", lambda index: True)
        monkeypatch.setattr(pdl, "_INTERPRETED", True)  # the interpreter has no griddepcontrol either
        assert pdl.launch_options(cuda) == {"PDL": False}
    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    assert pdl.launch_options(cuda) == {"PDL": False}, "the context restores the setting"


def test_the_context_is_restored_when_the_body_raises():
    with pytest.raises(RuntimeError), pdl.programmatic_launch(True):
        raise RuntimeError("a capture failed")
    assert pdl._ENABLED.get() is False


def test_a_runner_forwards_inside_its_configured_launch_mode(monkeypatch):
    """`ModelRunner.run` (every forward, eager or replayed) sees the runner's own setting, whatever the caller's."""
    from prism.engine.runner import ModelRunner
    from prism.engine.step_payload import StepPayload
    from prism.kv.transfers import TransferPlan

    seen = []
    payload = StepPayload(TransferPlan(), [], [])  # (no rows fed device tokens: nothing to share between ranks)

    class Probe:
        programmatic_launch = True

        def _run(self, payload, token_ids):
            seen.append(pdl._ENABLED.get())
            return torch.empty(0)

    probe = Probe()
    with pdl.programmatic_launch(False):
        ModelRunner.run(probe, payload=payload)
    probe.programmatic_launch = False
    with pdl.programmatic_launch(True):
        ModelRunner.run(probe, payload=payload)
    assert seen == [True, False]


# ------------------------------------------------------------------ what the compiler emits (Hopper, no GPU needed)
# Compiled in a child process: this one may run under the Triton interpreter, which compiles nothing.
COMPILE_FOR_HOPPER = r'''
import json, sys
import triton
import triton.language as tl
from prism.ops import fused_norms, gemv, skinny_gemm
from prism.testing import kernel_signatures as sig
from prism.testing.offline_compile import compile_for_hopper
from prism.ops.pdl import wait_for_predecessors


@triton.jit
def planted_reads_then_waits(x_ptr, y_ptr, PDL: tl.constexpr):
    x = tl.load(x_ptr)
    wait_for_predecessors(PDL)
    tl.store(y_ptr, x)


def ptx(kernel, signature, constexprs):
    return compile_for_hopper(kernel, signature, {"PDL": True, **constexprs}).asm["ptx"]


knobs = {"BLOCK_N": 8, "BLOCK_K": 512, "NUM_STAGES": 3, "NORM_IN": False, "BLOCK_P": 1}
gemv_args, silu_args, skinny_args = sig.GEMV, sig.GEMV_SILU_AND_MUL, sig.SKINNY_GEMM
skinny_knobs = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256, "NUM_STAGES": 4, "PRECISION": "tf32", "SPLIT_K": 1}
cases = {
    "gemv": (gemv._gemv_kernel, gemv_args, {**knobs, "ADD_RESIDUAL": False}),
    # the residual add + RMSNorm folded in (`gemv.ResidualRow`): the norm's partial sums are loaded first
    "gemv, norm in": (gemv._gemv_kernel, gemv_args, {**knobs, "NORM_IN": True, "BLOCK_P": 512,
                                                      "ADD_RESIDUAL": False}),
    "gemv, residual out": (gemv._gemv_kernel, gemv_args, {**knobs, "ADD_RESIDUAL": True}),
    # PDL = 2 (`pdl.TRIGGER_FIRST`): the next kernel is let in before the wait, which still precedes every access
    "gemv, trigger first": (gemv._gemv_kernel, gemv_args, {**knobs, "ADD_RESIDUAL": True, "PDL": 2}),
    "gemv_silu_and_mul": (gemv._gemv_silu_and_mul_kernel, silu_args, knobs),
    "gemv_silu_and_mul, norm in": (gemv._gemv_silu_and_mul_kernel, silu_args,
                                   {**knobs, "NORM_IN": True, "BLOCK_P": 512}),
    # an int argument equal to 1 is compiled as a constant (an intermediate of one row)
    "gemv_silu_and_mul, INTER = 1": (gemv._gemv_silu_and_mul_kernel,
                                     sig.without(silu_args, "INTER"), {**knobs, "INTER": 1}),
    # a few rows through tensor cores (`skinny_gemm`), its K split over programs, and the split's sums
    "skinny_gemm": (skinny_gemm._skinny_gemm_kernel, skinny_args, {**skinny_knobs, "SILU": False}),
    "skinny_gemm, silu": (skinny_gemm._skinny_gemm_kernel, skinny_args, {**skinny_knobs, "SILU": True}),
    "skinny_gemm, split K": (skinny_gemm._skinny_gemm_kernel, skinny_args,
                             {**skinny_knobs, "SILU": True, "SPLIT_K": 2}),
    "skinny_gemm, split sums": (skinny_gemm._split_sums_kernel, sig.SPLIT_SUMS,
                                {"SPLIT_K": 2, "SILU": True, "BLOCK": 1024}),
    # one row, called directly: a launch compiles an int argument equal to 1 as a constant (no tensor methods on it)
    "skinny_gemm, split K, one row": (skinny_gemm._skinny_gemm_kernel, sig.without(skinny_args, "M"),
                                      {**skinny_knobs, "SILU": True, "SPLIT_K": 2, "M": 1}),
    "skinny_gemm, split sums, one row": (skinny_gemm._split_sums_kernel, sig.without(sig.SPLIT_SUMS, "M"),
                                         {"SPLIT_K": 2, "SILU": True, "BLOCK": 1024, "M": 1}),
    "add_rms_norm": (fused_norms._add_rms_norm_kernel, sig.ADD_RMS_NORM, {"DTYPE": tl.bfloat16, "BLOCK": 4096}),
    "planted: reads, then waits": (planted_reads_then_waits, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {}),
}
memory = ("ld.global", "st.global", "cp.async", "atom.", "red.")
out = {}
for name, (kernel, signature, constexprs) in cases.items():
    try:
        text = ptx(kernel, signature, constexprs)
    except Exception as error:  # the case fails, not the others
        out[name] = {"error": f"{type(error).__name__}: {error}"[:1000]}
        continue
    first = min([text.find(m) for m in memory if text.find(m) >= 0] or [len(text)])
    out[name] = {"wait": text.find("griddepcontrol.wait"), "first_memory_access": first,
                 "launch_dependents": text.find("griddepcontrol.launch_dependents"),
                 "async_copies": text.count("cp.async")}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def hopper_ptx_order(tmp_path_factory) -> dict:
    import json

    from prism.testing.offline_compile import run_outside_interpreter

    script = tmp_path_factory.mktemp("hopper") / "compile_for_hopper.py"  # @triton.jit needs a source file
    script.write_text(COMPILE_FOR_HOPPER)
    done = run_outside_interpreter([str(script)], script.parent, timeout_s=300)
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip(f"cannot compile for sm_90 here: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not pdl.HAVE_TRITON, reason="needs Triton")
@pytest.mark.parametrize("case", ["gemv", "gemv, norm in", "gemv, residual out", "gemv, trigger first",
                                  "gemv_silu_and_mul", "skinny_gemm", "skinny_gemm, silu", "skinny_gemm, split K",
                                  "skinny_gemm, split sums", "skinny_gemm, split K, one row",
                                  "skinny_gemm, split sums, one row",
                                  "gemv_silu_and_mul, norm in", "gemv_silu_and_mul, INTER = 1", "add_rms_norm"])
def test_the_compiled_kernel_waits_before_its_first_memory_access(hopper_ptx_order, case):
    """The source rule above, checked again where it matters: in the PTX for Hopper, `griddepcontrol.wait` comes
    before the first global load, store, async copy or atomic (no helper, alias or compiler reordering moved a
    memory access ahead of it). The planted kernel that loads first shows the check can fail."""
    order = hopper_ptx_order[case]
    assert "error" not in order, f"does not compile for sm_90: {order.get('error')}"
    assert order["wait"] >= 0, "PDL on, but no griddepcontrol.wait in the kernel"
    assert order["wait"] < order["first_memory_access"], order
    assert order["launch_dependents"] >= 0, "PDL on, but the next kernel is never let in"
    if case.startswith(("gemv", "skinny_gemm")) and "split sums" not in case:
        # the pipelined weight loop compiled as a launch specializes it (aligned operands): the asynchronous copies
        # this check must see before the wait are there
        assert order["async_copies"] > 0, "no cp.async: not the kernel a launch compiles"
    if case == "gemv, trigger first":
        assert order["launch_dependents"] < order["wait"], order
    planted = hopper_ptx_order["planted: reads, then waits"]
    assert 0 <= planted["first_memory_access"] < planted["wait"], planted


@pytest.mark.parametrize("enabled", [True, False])
def test_a_runner_captures_its_graphs_inside_its_launch_mode(monkeypatch, enabled):
    """What a graph captures is what it replays: the row and packed graphs are captured inside the runner's own
    launch mode (on a CPU pool the captures run and record nothing; the mode they see is what the test checks)."""
    from prism.engine.cuda_graphs import RowGraphs
    from prism.engine.llm import LLM
    from prism.engine.packed_graphs import PackedGraphs
    from prism.testing.checkpoints import ensure_tiny_checkpoint

    seen = []
    for holder in (RowGraphs, PackedGraphs):
        capture = holder.capture
        monkeypatch.setattr(holder, "capture", lambda self, capture=capture: seen.append(pdl._ENABLED.get())
                            or capture(self))
    llm = LLM(ensure_tiny_checkpoint(), page_size=16, num_gpu_pages=32, graph_rows_without_cuda=True,
              cuda_graph_max_packed_tokens=64, programmatic_launch=enabled)
    assert seen == [enabled, enabled]
    assert llm.engine.runner.programmatic_launch is enabled
    assert pdl._ENABLED.get() is False, "the start leaves the caller's mode as it was"
