"""benchmarks/offload_overlap.py's interval arithmetic: how much of the copies' time lies inside the kernels' time
(the script's only logic that does not need a GPU), on intervals whose answer is worked out by hand."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script_once


@pytest.fixture(scope="module")
def script():
    return load_script_once("offload_overlap")


@pytest.mark.parametrize("copies, kernels, hidden", [
    ([(0, 10), (20, 30)], [(5, 25)], 10),  # the second half of one copy and the first half of the other
    ([(0, 10)], [(2, 4), (3, 6), (8, 20)], 6),  # overlapping kernels count once: [2, 6] and [8, 10]
    ([(0, 10), (5, 15)], [(0, 15)], 15),  # overlapping copies count once
    ([(0, 10)], [(10, 20), (-5, 0)], 0),  # touching is not overlapping
    ([(0, 10)], [], 0),
])
def test_overlap(script, copies, kernels, hidden):
    assert script.overlap(copies, kernels) == hidden


def test_union_merges_and_sorts(script):
    assert script._union([(5, 7), (0, 2), (1, 3), (7, 9)]) == [(0, 3), (5, 9)]
