"""benchmarks/layer_ab.py: its refusals on a CPU machine (the timing itself needs a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import BENCHMARKS, ROOT


def _run(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(BENCHMARKS / "layer_ab.py"), *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_refuses_rounds_below_one():
    proc = _run("--rounds", "0")
    assert proc.returncode == 2 and "--rounds must be at least 1" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_says_it_needs_a_gpu():
    proc = _run("--tag", "x")
    assert proc.returncode != 0 and "benchmarks/layer_ab.py needs a CUDA GPU" in proc.stderr + proc.stdout
