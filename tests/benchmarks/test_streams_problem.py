"""benchmarks/gemm.py streams' problem (common.retained_rows_problem, the part that needs no GPU): each expert keeps
round(retain * load) of its pairs, and the buffer's rows, their tokens and the per-token slots agree with each other;
every stream variant runs each of the backward's ops once."""

from __future__ import annotations

import common
import pytest
import torch

SHAPE, TOKENS = dict(dim=16, hidden_dim=8, num_experts=8, top_k=2), 64


@pytest.mark.parametrize("retain", [1.0, 0.75, 0.5])
def test_problem_rows(retain):
    p = common.retained_rows_problem(SHAPE, TOKENS, retain, device="cpu")
    n_tok, n_exp, top_k, ffn = TOKENS, SHAPE["num_experts"], SHAPE["top_k"], SHAPE["hidden_dim"]
    slot_TK = p["slot_TK"]
    kept = slot_TK[slot_TK >= 0]
    assert torch.equal(kept.sort().values, torch.arange(p["rows"]))  # every buffer row holds one pair
    tokens = torch.arange(n_tok).unsqueeze(1).expand(n_tok, top_k)[slot_TK >= 0]
    assert torch.equal(p["tok_R"][kept], tokens)  # row s is a pair of token tok_R[s]
    sizes = torch.diff(p["offsets_E"].long(), prepend=torch.zeros(1, dtype=torch.long))
    assert torch.equal(sizes, torch.round(retain * p["loads_E"].double()).long())
    assert int(p["loads_E"].sum()) == n_tok * top_k and p["dh_RF2"].shape == (p["rows"], 2 * ffn)
    # the rows of group e are pairs routed to expert e, in expert order
    experts_R = p["ids_TK"].flatten()[p["pair_R"]]
    assert torch.equal(experts_R, torch.repeat_interleave(torch.arange(n_exp), sizes))
    if retain == 1.0:
        assert p["rows"] == n_tok * top_k
    else:
        assert 0 < p["rows"] < n_tok * top_k


def test_every_variant_runs_each_op_once():
    p = common.retained_rows_problem(SHAPE, TOKENS, 0.5, device="cpu")
    ops = set(common.backward_ops(p))
    for name, lanes in common.STREAM_VARIANTS.items():
        names = [n for lane in lanes for n in lane]
        assert sorted(names) == sorted(ops), name
        assert len(lanes) - 1 <= 2, name  # gemm.py streams makes two side streams
