"""lrmoe.ops.hopper and the "hopper" backend on the CPU: the ops' references (the portable ops with h kept
interleaved) pass opcheck, and the backend's composition (h interleaved in forward, the retained rows' h gathered
row-aligned for the backward's epilogue, recomputed or read back) gives the portable backend's outputs and
gradients through the whole step. The CUDA kernels (quack) are tested against the portable backend on an sm_90
GPU (tests/nn/test_cuda_hopper.py)."""

from __future__ import annotations

import pytest
import torch

from lrmoe.functional.expert_kernels import choose_kernels
from lrmoe.functional.options import BackwardOptions
from lrmoe.ops import hopper_down, hopper_gate_up, hopper_rows_backward, hopper_token_rows_backward
from lrmoe.ops.hopper import interleave_halves, split_interleaved
from step_case import run_step


def _weights(E=3, D=8, F=6, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * F, D, generator=gen, dtype=dtype), torch.randn(E, D, F, generator=gen, dtype=dtype))


def test_interleave_puts_gate_and_up_columns_side_by_side_and_back():
    h = torch.arange(12.0).view(2, 6)  # gate columns 0-2, up columns 3-5
    inter = interleave_halves(h)
    assert inter[0].tolist() == [0, 3, 1, 4, 2, 5]
    torch.testing.assert_close(split_interleaved(inter), h, rtol=0, atol=0)


@pytest.mark.parametrize("with_rows", [False, True])
def test_the_ops_pass_opcheck(with_rows):
    gate_up, down = _weights()
    x = torch.randn(7, 8, dtype=torch.float64)
    rows = torch.tensor([6, 0, 0, 3, 2, 5, 1, 4]) if with_rows else None
    n = 8 if with_rows else 7
    offsets = torch.tensor([3, 3, n], dtype=torch.int32)  # an empty group in the middle
    torch.library.opcheck(hopper_gate_up, (x, gate_up, rows, offsets))
    h, phi, _ = hopper_gate_up(x, gate_up, rows, offsets)
    torch.library.opcheck(hopper_down, (phi, down, offsets))
    dy = torch.randn(n, 8, dtype=torch.float64)
    torch.library.opcheck(hopper_rows_backward, (dy, x, rows, offsets, gate_up, down, h, True, True, True))
    torch.library.opcheck(hopper_rows_backward, (dy, x, rows, offsets, gate_up, down, h, False, True, False))
    g = torch.randn(5, 8, dtype=torch.float64)
    tok = torch.tensor([4, 0, 0, 3, 2, 1, 1, 4])[:n]
    coef = torch.rand(n, dtype=torch.float64)
    for needs in ((True, True, True), (False, True, False)):
        torch.library.opcheck(hopper_token_rows_backward, (g, tok, coef, x, rows, offsets, gate_up, down, h, *needs))


def test_gate_up_is_the_swiglu_of_each_rows_expert():
    gate_up, _ = _weights()
    x = torch.randn(5, 8, dtype=torch.float64)
    rows = torch.tensor([4, 1, 1, 0, 2, 3])
    offsets = torch.tensor([2, 5, 6], dtype=torch.int32)
    h, phi, phi_sq = hopper_gate_up(x, gate_up, rows, offsets)
    experts = [0, 0, 1, 1, 1, 2]
    for i, (r, e) in enumerate(zip(rows.tolist(), experts)):
        pre = gate_up[e] @ x[r]
        gate, up = pre[:6], pre[6:]
        torch.testing.assert_close(h[i, 0::2], gate)
        torch.testing.assert_close(h[i, 1::2], up)
        torch.testing.assert_close(phi[i], torch.nn.functional.silu(gate) * up)
        torch.testing.assert_close(phi_sq[i], (phi[i].float() ** 2).sum())


@pytest.mark.parametrize("activations", ["save", "recompute"])
@pytest.mark.parametrize("retain", [1.0, 0.5])
def test_the_hopper_backend_gives_the_portable_backends_step(retain, activations):
    got, want = run_step("hopper", retain, activations), run_step("portable", retain, activations)
    for name, a, b in zip(("out", "x", "gate_up", "down", "gates"), got, want):
        torch.testing.assert_close(a, b, msg=name)
    assert want[3].abs().sum() > 0


def test_choose_kernels_keeps_the_portable_backend_where_hopper_cannot_run():
    x = torch.randn(4, 8)
    assert choose_kernels("auto", x, 8, 8, blocked=False) == "portable"
    assert choose_kernels("portable", x, 8, 8, blocked=False) == "portable"
    assert choose_kernels("auto", x.bfloat16(), 8, 8, blocked=False) == "portable"
    with pytest.raises(ValueError, match="kernels='hopper' cannot run here: x is on cpu"):
        choose_kernels("hopper", x, 8, 8, blocked=False)
    with pytest.raises(ValueError, match="kernels must be one of"):
        BackwardOptions(kernels="cutlass")


def test_token_rows_backward_is_the_rows_backward_of_the_scaled_rows_with_the_router_gradient():
    """hopper_token_rows_backward's rows are coef * g[tok]: the gradients of hopper_rows_backward on those dy rows,
    and each row's <g_t W_down^T, phi_r>, the dot of the unscaled row with the row's expert output."""
    gate_up, down = _weights()
    x = torch.randn(7, 8, dtype=torch.float64)
    rows = torch.tensor([6, 0, 0, 3, 2, 5, 1, 4])
    offsets = torch.tensor([3, 3, 8], dtype=torch.int32)
    h, phi, _ = hopper_gate_up(x, gate_up, rows, offsets)
    g = torch.randn(5, 8, dtype=torch.float64)
    tok = torch.tensor([4, 0, 0, 3, 2, 1, 1, 4])
    coef = torch.rand(8, dtype=torch.float64)
    dx, ggu, gd, dot = hopper_token_rows_backward(g, tok, coef, x, rows, offsets, gate_up, down, h, True, True, True)
    want = hopper_rows_backward(g[tok] * coef[:, None], x, rows, offsets, gate_up, down, h, True, True, True)
    for a, b in zip((dx, ggu, gd), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    experts = [0, 0, 0, 2, 2, 2, 2, 2]
    y = torch.stack([down[e] @ phi[i] for i, e in enumerate(experts)])
    torch.testing.assert_close(dot, (g[tok] * y).sum(-1), rtol=1e-12, atol=1e-12)
