"""Where the Triton kernels come from: the import package ``lrmoe_kernels`` that installing lrmoe maps to kernels/.
A checkout that is only on PYTHONPATH has no such package; there the first CUDA call must say how to install, not
fall back to the slow reference silently. The benchmark scripts take the kernels through lrmoe's lookup
(common.lrmoe_kernels), never by name, so a script and the layers it times use the same modules."""

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
# file runs and the editable install of lrmoe (which maps lrmoe_kernels to kernels/) is not seen.
PLAIN_CHECKOUT = """
import sys
sys.path[:0] = [{root!r}, {benchmarks!r}]
sys.path += {site!r}
import common
try:
    common.lrmoe_kernels("grouped_gemm")
except ImportError as e:
    print("ImportError:", e)
"""


def test_a_checkout_without_install_is_told_how_to_install():
    folders = [*site.getsitepackages(), site.getusersitepackages()]  # wherever torch and triton are installed
    code = PLAIN_CHECKOUT.format(root=str(ROOT), benchmarks=str(BENCHMARKS), site=folders)
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ImportError:"), run.stdout
    assert "'lrmoe_kernels'" in run.stdout and "pip install" in run.stdout, run.stdout


def test_the_installed_package_is_the_kernels_folder():
    from lrmoe.ops._kernels import kernel_module

    module = kernel_module("grouped_gemm")
    assert module.__name__ == "lrmoe_kernels.grouped_gemm"
    assert Path(module.__file__).resolve() == ROOT / "kernels" / "grouped_gemm.py"


def test_no_script_imports_the_kernels_by_name():
    found = [(path.name, m.group(0)) for path in BENCHMARKS.glob("*.py")
             for m in re.finditer(r"^\s*(from|import) lrmoe_kernels\b.*$", path.read_text(), re.M)]
    assert not found, found
