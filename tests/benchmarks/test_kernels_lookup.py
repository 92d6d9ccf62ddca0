"""The benchmark scripts find the Triton kernels in a checkout that is only on PYTHONPATH, as on a GPU machine with
no install: there ``import lrmoe_kernels`` fails (the package is the checkout's kernels/ folder, which lrmoe.ops
loads under that name on first use), so the scripts take the kernels from common.lrmoe_kernels."""

from __future__ import annotations

import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# A fresh interpreter without site processing: the site-packages folders are put on sys.path by hand, so no .pth
# file runs and an editable install of lrmoe (which maps lrmoe_kernels to kernels/) is not seen.
PLAIN_CHECKOUT = """
import sys
sys.path[:0] = [{root!r}, {benchmarks!r}]
sys.path += {site!r}
import common
try:
    import lrmoe_kernels
    print("imported by name")
except ModuleNotFoundError:
    print("not importable by name")
print(common.lrmoe_kernels("grouped_gemm").gather_grouped_mm_triton.__module__)
"""


def test_common_finds_the_kernels_where_an_import_by_name_fails():
    folders = [*site.getsitepackages(), site.getusersitepackages()]  # wherever torch and triton are installed
    code = PLAIN_CHECKOUT.format(root=str(ROOT), benchmarks=str(BENCHMARKS), site=folders)
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["not", "importable", "by", "name", "lrmoe_kernels.grouped_gemm"], run.stdout


def test_no_script_imports_the_kernels_by_name():
    found = [(path.name, m.group(0)) for path in BENCHMARKS.glob("*.py")
             for m in re.finditer(r"^\s*(from|import) lrmoe_kernels\b.*$", path.read_text(), re.M)]
    assert not found, found
