"""Sessions: `tests` (CPU: unit tests + specs + reproducers), `gpu_tests`, `bench`, `lint`.

GPU sessions must also work as `nox --no-venv -s gpu_tests` on the GPU machine, which has torch, triton and
transformers installed but no package registry: with --no-venv nothing is installed and `src/` is put on
PYTHONPATH instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

# The CPU torch wheel lies on this machine's disk; asking for exactly it never pulls a CUDA build.
CPU_TORCH = "torch==2.13.0"


def _src_on_path() -> dict[str, str]:
    """PYTHONPATH with src/ first, keeping what the caller had (e.g. a --target dir of carried wheels)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}


def _install(session: nox.Session, *extras: str) -> dict[str, str]:
    """Install the project (CPU) or, without a venv, only point PYTHONPATH at src/."""
    env = _src_on_path()
    if session.venv_backend == "none":
        return env
    session.install(CPU_TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec)
    return env


def _failed(session: nox.Session, *args: str, env: dict[str, str]) -> bool:
    """Run a command; whether it failed (nox logs how), so that what comes after still runs."""
    try:
        session.run(*args, env=env)
    except CommandFailed:
        return True
    return False


def _failed_reproducers(session: nox.Session, env: dict[str, str]) -> list[str]:
    """Every reproducer, each run whatever the others did: the names of those that did not exit 0."""
    scripts = sorted(p for p in (ROOT / "reproducers").glob("*.py") if not p.name.startswith("_"))
    python = sys.executable if session.venv_backend == "none" else "python"
    failed = [script.name for script in scripts if _failed(session, python, str(script), env=env)]
    session.log(f"{len(scripts) - len(failed)} of {len(scripts)} reproducers exited 0")
    return failed


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """CPU: unit/integration/parity tests, property-based specs, then every reproducer (run even when a test failed:
    one failing reproducer once went unseen for a session behind a failed test)."""
    env = _install(session, "test")
    env["TRITON_INTERPRET"] = "1"
    env.setdefault("HYPOTHESIS_PROFILE", os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    tests_failed = _failed(session, "pytest", "-m", "not gpu", *session.posargs, env=env)
    reproducers_failed = _failed_reproducers(session, env)
    if tests_failed or reproducers_failed:
        session.error(f"pytest {'failed' if tests_failed else 'passed'}; reproducers that failed: "
                      f"{reproducers_failed or 'none'}")


@nox.session(python=False)
def gpu_tests(session: nox.Session) -> None:
    """GPU (run with --no-venv on the H200): tests marked `gpu`."""
    env = _src_on_path()
    session.run(sys.executable, "-m", "pytest", "-m", "gpu", *session.posargs, env=env)


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """GPU benchmarks (run with --no-venv on the H200)."""
    env = _src_on_path()
    benches = sorted((ROOT / "bench").glob("bench_*.py"))
    if not benches:
        session.error("no benchmarks in bench/ yet")
    # The checkpoint is built in its own process: a benchmark that built it measured noisier (make_checkpoint.py).
    session.run(sys.executable, str(ROOT / "bench" / "make_checkpoint.py"), env=env)
    for script in benches:
        session.run(sys.executable, str(script), *session.posargs, env=env)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        session.warn("matplotlib is not installed: no plots (install it, or carry its wheels, and run bench/plots.py)")
    else:
        session.run(sys.executable, str(ROOT / "bench" / "plots.py"), env=env)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "specs", "tests", "reproducers", "noxfile.py")
