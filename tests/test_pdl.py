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

OPS = Path(pdl.__file__).parent


def _is_launch_options(keyword: ast.keyword) -> bool:
    value = keyword.value
    return (keyword.arg is None and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "launch_options")


def early_launched_kernels(sources: dict[str, str]) -> set[str]:
    """Names of the kernels launched as `kernel[grid](..., **launch_options(...))` in these module sources."""
    names = set()
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and any(map(_is_launch_options, node.keywords))):
                names.add(node.func.value.id)
    return names


def _is_wait(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and isinstance(statement.value.func, ast.Name) and statement.value.func.id == "wait_for_predecessors"
            and [a.id for a in statement.value.args if isinstance(a, ast.Name)] == ["PDL"])


def _touches_memory(statement: ast.stmt) -> bool:
    """Whether a statement may read or write memory a predecessor writes or reads: a load, a store, an atomic,
    or a call to a helper (which might)."""
    for node in ast.walk(statement):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and (func.attr in ("load", "store") or func.attr.startswith("atomic")):
            return True
        if isinstance(func, ast.Name) and func.id not in ("range", "min"):
            return True
    return False


def _waits_first(fn: ast.FunctionDef) -> bool:
    """Before its `wait_for_predecessors(PDL)` a kernel does only address arithmetic."""
    for statement in fn.body:
        if _is_wait(statement):
            return True
        if _touches_memory(statement):
            return False
    return False


def rule_violations(sources: dict[str, str]) -> list[str]:
    """Kernels launched early that touch memory before `wait_for_predecessors(PDL)` (or that are not found),
    and kernels with a PDL parameter never launched with `launch_options` (their PDL would stay unset)."""
    kernels: dict[str, ast.FunctionDef] = {}
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                kernels.setdefault(node.name, node)
    launched = early_launched_kernels(sources)
    problems = [f"{name}: launched early but not found" for name in sorted(launched - kernels.keys())]
    problems += [f"{name}: launched early but touches memory before wait_for_predecessors(PDL)"
                 for name in sorted(launched & kernels.keys()) if not _waits_first(kernels[name])]
    with_pdl = {name for name, fn in kernels.items() if "PDL" in [a.arg for a in fn.args.args]
                and name != "wait_for_predecessors"}
    problems += [f"{name}: takes PDL but is never launched with launch_options" for name in sorted(with_pdl - launched)]
    return problems


def ops_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(OPS.glob("*.py"))}


def test_every_kernel_launched_early_waits_for_its_predecessors_first():
    sources = ops_sources()
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

def launch(x, dev):
    _reads_then_waits[(1,)](x, x, **launch_options(dev))
    _never_waits[(1,)](x, **launch_options(dev))
    _waits_first[(1,)](x, **launch_options(dev))
    _calls_a_helper_before_it_waits[(1,)](x, **launch_options(dev))
'''


def test_the_rule_check_catches_a_kernel_that_reads_before_it_waits_or_never_waits():
    problems = rule_violations({"planted.py": textwrap.dedent(PLANTED)})
    assert problems == [
        "_calls_a_helper_before_it_waits: launched early but touches memory before wait_for_predecessors(PDL)",
        "_never_waits: launched early but touches memory before wait_for_predecessors(PDL)",
        "_reads_then_waits: launched early but touches memory before wait_for_predecessors(PDL)"]
    unlaunched = PLANTED.replace("    _waits_first[(1,)](x, **launch_options(dev))\n", "")
    assert "_waits_first: takes PDL but is never launched with launch_options" in rule_violations(
        {"planted.py": textwrap.dedent(unlaunched)})


def test_launch_options_are_off_outside_the_context_on_the_cpu_and_before_hopper(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    monkeypatch.setattr(pdl, "_supports_pdl", lambda index: True)
    assert pdl.launch_options(cuda) == {"PDL": False}, "off unless a runner asked for it"
    with pdl.programmatic_launch(True):
        assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
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

    seen = []

    class Probe:
        programmatic_launch = True

        def _run(self, payload, token_ids):
            seen.append(pdl._ENABLED.get())
            return torch.empty(0)

    probe = Probe()
    with pdl.programmatic_launch(False):
        ModelRunner.run(probe, payload=None)
    probe.programmatic_launch = False
    with pdl.programmatic_launch(True):
        ModelRunner.run(probe, payload=None)
    assert seen == [True, False]
