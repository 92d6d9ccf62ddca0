"""benchmarks/sustained_rate.py's windows (the part that needs no GPU), on batches worked out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_sustained_rate", BENCHMARKS / "sustained_rate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("batches, window, medians", [
    # (GPU ms at the batch's end, ms per call): windows of 10 ms end at the batches ending at 10.0 and 21.0
    ([(3.0, 1.0), (6.0, 3.0), (10.0, 2.0), (14.0, 5.0), (21.0, 4.0), (25.0, 9.0)], 10.0, [2.0, 5.0]),
    ([(5.0, 1.0)], 10.0, []),  # a partial window is dropped
    ([(12.0, 7.0), (13.0, 1.0)], 10.0, [7.0]),  # a batch longer than the window closes it alone
])
def test_window_medians(script, batches, window, medians):
    assert script.window_medians(batches, window) == medians
