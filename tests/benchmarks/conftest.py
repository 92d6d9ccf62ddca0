"""The benchmarks' tests: benchmarks/common.py imported as ``common`` (the scripts import it so, from their own
folder), and ``run_script`` to run a script in a subprocess on CPU, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture
def run_script(tmp_path):
    """run_script("memory.py", "batch", ...) -> stdout: the script in a fresh process (cwd: a temporary folder,
    OMP_NUM_THREADS=1, the repository importable); a failure shows its output."""

    def run(script: str, *args: str, timeout: int = 300) -> str:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, str(BENCHMARKS / script), *args]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc.stdout

    return run
