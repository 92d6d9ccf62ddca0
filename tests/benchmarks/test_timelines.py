"""benchmarks/common.py's interval arithmetic, on intervals and batches whose answer is worked out by hand: a GPU
timeline's span, busy time and idle gaps (layer.py profile --timeline) and the kernels it takes from a Chrome
trace; how much of the copies' time lies inside the kernels' time (layer.py offload); the sustained-rate windows
(gemm.py sustained)."""

from __future__ import annotations

import common
import pytest



@pytest.mark.parametrize("intervals, span, busy, gaps", [
    ([(0, 10, "a"), (12, 20, "b"), (25, 30, "c")], 30, 23, [(2, "a", "b"), (5, "b", "c")]),
    # two streams: b runs inside a, c starts before a ends; the one gap is after the later-ending kernel
    ([(0, 10, "a"), (2, 4, "b"), (8, 15, "c"), (18, 20, "d")], 20, 17, [(3, "c", "d")]),
    ([(0, 10, "a"), (2, 4, "b")], 10, 10, []),  # the last kernel to start ends first: the span ends with a
    ([(0, 10, "a"), (10, 12, "b")], 12, 12, []),  # touching: no gap
    ([(5, 9, "a")], 4, 4, []),
])
def test_timeline_stats(intervals, span, busy, gaps):
    assert common.timeline_stats(intervals) == (span, busy, gaps)


def test_kernel_intervals_keeps_gpu_work_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 10.0, "dur": 5.0, "name": "k2"},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 50.0, "name": "aten::mm"},
        {"ph": "X", "cat": "gpu_memset", "ts": 1.0, "dur": 2.0, "name": "Memset"},
        {"ph": "i", "cat": "kernel", "ts": 3.0, "name": "marker"},
        {"ph": "X", "cat": "cuda_runtime", "ts": 0.5, "dur": 1.0, "name": "cudaLaunchKernel"},
    ]}
    assert common.kernel_intervals(trace) == [(1.0, 3.0, "Memset"), (10.0, 15.0, "k2")]



@pytest.mark.parametrize("copies, kernels, hidden", [
    ([(0, 10), (20, 30)], [(5, 25)], 10),  # the second half of one copy and the first half of the other
    ([(0, 10)], [(2, 4), (3, 6), (8, 20)], 6),  # overlapping kernels count once: [2, 6] and [8, 10]
    ([(0, 10), (5, 15)], [(0, 15)], 15),  # overlapping copies count once
    ([(0, 10)], [(10, 20), (-5, 0)], 0),  # touching is not overlapping
    ([(0, 10)], [], 0),
])
def test_overlap(copies, kernels, hidden):
    assert common.overlap(copies, kernels) == hidden


def test_union_merges_and_sorts():
    assert common.union([(5, 7), (0, 2), (1, 3), (7, 9)]) == [(0, 3), (5, 9)]



@pytest.mark.parametrize("batches, window, medians", [
    # (GPU ms at the batch's end, ms per call), windows of 10 ms: [0, 10) holds 1 and 3, [10, 20) holds 2, 5 and
    # 4; [20, 30) holds the last batch, and the run ended inside it
    ([(3.0, 1.0), (6.0, 3.0), (10.0, 2.0), (14.0, 5.0), (19.0, 4.0), (25.0, 9.0)], 10.0, [2.0, 4.0]),
    ([(5.0, 1.0)], 10.0, []),  # only the last window: dropped
    ([], 10.0, []),
    # a batch longer than a window: [0, 10) and [20, 30) are empty, [10, 20) holds 7 alone, [30, 40) is the last
    ([(12.0, 7.0), (31.0, 1.0)], 10.0, [7.0]),
])
def test_window_medians(batches, window, medians):
    assert common.window_medians(batches, window) == medians
