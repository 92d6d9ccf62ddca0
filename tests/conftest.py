"""Shared test configuration.

Hypothesis profiles: "ci" (the default) keeps every property test small and fast so the whole suite runs in
minutes on two CPU cores; "dev" explores more examples. Pick one with HYPOTHESIS_PROFILE=dev.

Triton: without a GPU, kernels run in Triton's interpreter, which must be switched on before any @triton.jit
function is defined, so it is set here, before the tests import lrmoe_kernels. On a GPU machine the kernels
compile for the device as usual.
"""

from __future__ import annotations

import os
import shutil

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run these kernel tests with these versions, or None. Triton before 3.7 (3.6 is
    torch 2.11's) converts one-element arrays to Python scalars, which numpy 2.4 refuses: every kernel test then
    fails with "only 0-dimensional arrays can be converted to Python scalars" (seen with torch 2.11 + Triton 3.6.0 +
    numpy 2.4.6 on the CPU; numpy 2.3.5 passed)."""
    def major_minor(version: str) -> tuple[int, int]:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1, used without a GPU) fails with numpy "
                f"{numpy_version}: install numpy<2.4 or Triton>=3.7")
    return None


if os.environ.get("TRITON_INTERPRET") == "1":
    import numpy
    import triton

    if problem := interpreter_numpy_problem(triton.__version__, numpy.__version__):
        raise pytest.UsageError(problem)

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
