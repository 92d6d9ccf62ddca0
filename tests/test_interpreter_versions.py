"""The test setup's own check: Triton's interpreter and numpy versions that cannot run the kernel tests together."""

from __future__ import annotations

import pytest
from interpreter_versions import interpreter_numpy_problem


@pytest.mark.parametrize(
    "triton_version, numpy_version, refused",
    [
        ("3.6.0", "2.4.6", True),  # torch 2.11's Triton with the numpy of late 2026: the failing pair
        ("3.6.0", "2.10.1", True),
        ("3.5.1", "2.4.0", True),
        ("3.6.0", "2.3.5", False),
        ("3.7.1", "2.4.6", False),  # what CI installs
        ("4.0.0", "2.4.0", False),
        ("3.6.0rc1", "2.4.0rc1", True),
    ],
)
def test_interpreter_numpy_problem(triton_version, numpy_version, refused):
    problem = interpreter_numpy_problem(triton_version, numpy_version)
    assert (problem is not None) == refused
    if refused:
        assert "numpy<2.4" in problem and triton_version in problem
