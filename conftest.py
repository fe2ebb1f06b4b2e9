"""Hypothesis profiles shared by tests/ and specs/.

`ci` (the default under nox) is derandomized so a CI run is reproducible; `thorough` explores more.
Pick one with HYPOTHESIS_PROFILE=...
"""

import os

import torch

# Without a GPU, Triton kernels run in the interpreter (it must be set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_the_gil_switch_interval():
    """An engine sets the process's GIL switch interval (`EngineConfig.python_switch_interval_ms`): each test starts
    with the one it found."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)
