"""The layers through their CUDA kernels on CPU (tests/cuda_paths.py): the Triton kernels in the interpreter,
composed as the layers compose them, equal the CPU references. On a GPU the real CUDA tests cover this."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the CUDA kernels for real (tests/nn/test_cuda*.py)")
@pytest.mark.parametrize("part, cases", [("single", 7), ("ep", 10)])
def test_cuda_kernels_composed_by_the_layers_equal_the_cpu_references(part, cases):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "cuda_paths.py"), part], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ok = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == cases, run.stdout  # every case ran and matched (ep: each case on both ranks)
