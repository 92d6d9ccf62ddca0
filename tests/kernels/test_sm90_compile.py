"""Every Triton kernel in kernels/ compiles for an NVIDIA sm_90 GPU (H100/H200), checked on any machine.

The other kernel tests run in Triton's interpreter on a machine without a GPU, and the interpreter accepts programs
the GPU compiler rejects. tests/kernels/sm90_compile.py compiles each kernel, for the argument types and constexprs
its launcher really picks, through Triton's NVIDIA backend and bundled ptxas (no GPU needed); it must run without
TRITON_INTERPRET, so it runs in a subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


# On a GPU machine the kernel tests compile and run every kernel for the device itself, and this subprocess's
# ptxas pass over every config (minutes of CPU time) outlasted a 420 s GPU run of the suite under pytest-xdist.
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles the kernels for real in their tests")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "sm90_compile.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    compiled = set(re.findall(r"^ok\s+(\w+)", run.stdout, re.M))
    # Every kernel defined in kernels/ was launched by some launcher and compiled (a new kernel must be added to
    # the script's launcher calls, or this fails).
    defined = {name for path in (ROOT / "kernels").glob("*.py")
               for name in re.findall(r"@triton\.jit\s*\ndef (\w+_kernel)\(", path.read_text())}
    assert defined and defined <= compiled, (sorted(defined - compiled), out[-3000:])
