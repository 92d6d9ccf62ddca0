"""benchmarks/profile_layer.py's timeline arithmetic (--timeline): span, busy time and the idle gaps of GPU work,
on intervals whose answer is worked out by hand, and the kernels it takes from a Chrome trace."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script_once


@pytest.fixture(scope="module")
def script():
    return load_script_once("profile_layer")


@pytest.mark.parametrize("intervals, span, busy, gaps", [
    ([(0, 10, "a"), (12, 20, "b"), (25, 30, "c")], 30, 23, [(2, "a", "b"), (5, "b", "c")]),
    # two streams: b runs inside a, c starts before a ends; the one gap is after the later-ending kernel
    ([(0, 10, "a"), (2, 4, "b"), (8, 15, "c"), (18, 20, "d")], 20, 17, [(3, "c", "d")]),
    ([(0, 10, "a"), (2, 4, "b")], 10, 10, []),  # the last kernel to start ends first: the span ends with a
    ([(0, 10, "a"), (10, 12, "b")], 12, 12, []),  # touching: no gap
    ([(5, 9, "a")], 4, 4, []),
])
def test_timeline_stats(script, intervals, span, busy, gaps):
    assert script.timeline_stats(intervals) == (span, busy, gaps)


def test_kernel_intervals_keeps_gpu_work_only(script):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 10.0, "dur": 5.0, "name": "k2"},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 50.0, "name": "aten::mm"},
        {"ph": "X", "cat": "gpu_memset", "ts": 1.0, "dur": 2.0, "name": "Memset"},
        {"ph": "i", "cat": "kernel", "ts": 3.0, "name": "marker"},
        {"ph": "X", "cat": "cuda_runtime", "ts": 0.5, "dur": 1.0, "name": "cudaLaunchKernel"},
    ]}
    assert script.kernel_intervals(trace) == [(1.0, 3.0, "Memset"), (10.0, 15.0, "k2")]
