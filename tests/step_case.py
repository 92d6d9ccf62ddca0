"""One selective step on a small fp64 problem, for the tests of its seams (tests/functional/test_seams.py,
tests/ops/test_hopper_ops.py): the step run with a given transport, kernel backend, retain and activation policy,
"top" selection; returns the output and the gradients of x, the two weights and the gates for a fixed output
gradient."""

from __future__ import annotations

import torch

from lrmoe.functional.expert_step import StepConfig, selective_step
from lrmoe.functional.experts import plan_experts, retained_rows_bound
from lrmoe.functional.options import BackwardOptions
from lrmoe.functional.transport import IdentityTransport, Transport


def run_step(kernels: str = "portable", retain: float = 1.0, activations: str = "save",
             transport: Transport | None = None, T=24, D=8, F=12, E=4, K=2, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(E, 2 * F, D, generator=gen, dtype=torch.float64, requires_grad=True)
    down = torch.randn(E, D, F, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    gates = torch.rand(T, K, generator=gen, dtype=torch.float64, requires_grad=True)
    plan = plan_experts(ids, E, backward=BackwardOptions(retain=retain, selection="top"))
    cfg = StepConfig(dense=retain >= 1.0, metric="lrm", selection="top", generator=None, activations=activations,
                     max_rows=retained_rows_bound(T * K, E, retain), kernels=kernels)
    out = selective_step(x, gate_up, down, gates, ids.reshape(-1), plan.quotas, plan.uniform, None, cfg,
                         IdentityTransport() if transport is None else transport)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad(out, (x, gate_up, down, gates), g)]
