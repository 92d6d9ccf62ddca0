"""Shared test configuration.

Hypothesis profiles: "ci" (the default) keeps every property test small and fast so the whole suite runs in
minutes on two CPU cores; "dev" explores more examples. Pick one with HYPOTHESIS_PROFILE=dev.

Triton: without a GPU, kernels run in Triton's interpreter, which must be switched on before any @triton.jit
function is defined, so it is set here, before the tests import lrmoe_kernels; from then on tests ask
lrmoe_kernels.launch.interpreting(), the one place that reads it. On a GPU machine the kernels compile for the
device as usual.
"""

from __future__ import annotations

import os
import shutil

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from interpreter_versions import interpreter_numpy_problem  # noqa: E402  (this folder is on sys.path)

from lrmoe.ops._kernels import kernel_module  # noqa: E402  (after TRITON_INTERPRET is set; imports no kernel)

if (launch := kernel_module("launch")) is not None and launch.interpreting():
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

# pytest-xdist's --dist loadfile hands whole files to its workers in collection order (with
# --no-loadscope-reorder; by default it hands out the files with the most tests first, which leaves files made of one
# long test for the end, where one worker runs them alone). The files below take the longest on two CPU cores (a
# minute or more each, mostly compiling): they go first, so the many short files fill in around them.
SLOW_FIRST = (
    "kernels/test_sm90_compile.py",
    "nn/test_expert_parallel_compile.py",
    "nn/test_compile.py",
    "nn/test_expert_parallel_checkpoint.py",
    "benchmarks/test_ep_benchmarks.py",
    "test_cuda_paths_on_cpu.py",
    "nn/test_expert_parallel_fsdp.py",
    "demo/test_study.py",
    "benchmarks/test_train_e2e.py",
)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), here).replace(os.sep, "/"), len(rank)))
