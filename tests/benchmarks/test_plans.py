"""benchmarks/plans.py capacity runs on the CPU and its table says what the docs quote: the capped plan
keeps the whole budget when C covers every expert's waterfilled quota, less as the router skews, never more."""

from __future__ import annotations

import math


def test_table_kept_share_and_padding(run_script):
    out = run_script("plans.py", "capacity", "--tokens", "512", "--skew", "0", "2", "--retain", "0.75", "--factor",
                     "1", "4")
    rows = [line.split() for line in out.splitlines() if line and not line.startswith(("#", " skew"))]
    table = {(float(r[0]), float(r[3])): r for r in rows}
    assert len(rows) == 4 and set(table) == {(0.0, 1.0), (0.0, 4.0), (2.0, 1.0), (2.0, 4.0)}
    budget = int(0.75 * 512 * 8)  # the Qwen3 shape: k = 8, E = 128
    for (skew, factor), r in table.items():
        cap, kept_share, pad = int(r[4]), float(r[5]), float(r[6])
        assert cap == min(512, math.ceil(math.ceil(factor * budget / 128) / 8) * 8)  # the documented C
        assert 0 < kept_share <= 1
        assert abs(pad - (1 - kept_share * budget / (128 * cap))) < 2e-3  # padding is the blocks' rows not kept
    # four times the balanced quota holds every waterfilled quota of a near-balanced router; a skewed one at c = 1
    # does not keep its budget (its hot experts hit C), and more capacity keeps more
    assert float(table[(0.0, 4.0)][5]) == 1.0
    assert float(table[(2.0, 1.0)][5]) < float(table[(2.0, 4.0)][5])
    assert float(table[(2.0, 1.0)][5]) < 1.0
