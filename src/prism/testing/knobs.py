"""A module's launch knobs (its capitalized constants: tiles, splits, `MAX_ROWS`...) set for a while, then restored.

For specs, which cannot take pytest's `monkeypatch` inside a hypothesis example, and for the GPU sweeps in `bench/`
that time one knob set after another.
"""

from __future__ import annotations

import contextlib
from types import ModuleType


def parse_value(text: str):
    """A knob's or config field's value as written on a command line: true / false, an int, a float, else the
    text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@contextlib.contextmanager
def module_knobs(module: ModuleType, values: dict):
    """Within: `module`'s launch knobs (attribute name -> value) set to `values`; its own restored after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def ops_knob(name: str, default_module: str | None = None) -> tuple[ModuleType, str]:
    """(module, knob) of a launch knob named `MODULE.NAME` (`prism.ops.<MODULE>`), or a bare `NAME` of
    `default_module`. SystemExit with a message for a name without a module or a knob the module lacks."""
    import importlib

    module_name, _, knob = name.rpartition(".")
    module_name = module_name or default_module
    if not module_name or not knob:
        raise SystemExit(f"{name!r} is not MODULE.NAME")
    module = importlib.import_module(f"prism.ops.{module_name}")
    if not hasattr(module, knob):
        raise SystemExit(f"{module.__name__} has no knob {knob}")
    return module, knob


def set_ops_knob(assignment: str) -> None:
    """`MODULE.NAME=VALUE` (a command line's `--set`): `prism.ops.<MODULE>.<NAME>` set to VALUE (`parse_value`), for
    the rest of the process. SystemExit with a message for a malformed assignment or an unknown knob."""
    name, _, value = assignment.partition("=")
    if "." not in name or not value:
        raise SystemExit(f"--set: {assignment!r} is not MODULE.NAME=VALUE")
    module, knob = ops_knob(name)
    setattr(module, knob, parse_value(value))
