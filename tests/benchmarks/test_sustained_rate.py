"""benchmarks/sustained_rate.py's windows (the part that needs no GPU), on batches worked out by hand."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script_once


@pytest.fixture(scope="module")
def script():
    return load_script_once("sustained_rate")


@pytest.mark.parametrize("batches, window, medians", [
    # (GPU ms at the batch's end, ms per call), windows of 10 ms: [0, 10) holds 1 and 3, [10, 20) holds 2, 5 and
    # 4; [20, 30) holds the last batch, and the run ended inside it
    ([(3.0, 1.0), (6.0, 3.0), (10.0, 2.0), (14.0, 5.0), (19.0, 4.0), (25.0, 9.0)], 10.0, [2.0, 4.0]),
    ([(5.0, 1.0)], 10.0, []),  # only the last window: dropped
    ([], 10.0, []),
    # a batch longer than a window: [0, 10) and [20, 30) are empty, [10, 20) holds 7 alone, [30, 40) is the last
    ([(12.0, 7.0), (31.0, 1.0)], 10.0, [7.0]),
])
def test_window_medians(script, batches, window, medians):
    assert script.window_medians(batches, window) == medians
