"""The selective step's two seams (lrmoe.functional.transport, lrmoe.functional.expert_kernels) are declared
interfaces: the step calls nothing a transport or a kernel backend does not declare, branches on neither, and a
new implementation plugs in without touching the step."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from lrmoe.functional import expert_kernels
from lrmoe.functional.expert_kernels import BACKENDS, ExpertKernels, PortableKernels, expert_kernels as lookup
from lrmoe.functional.expert_step import StepConfig, selective_step
from lrmoe.functional.experts import plan_experts, retained_rows_bound
from lrmoe.functional.options import BackwardOptions
from lrmoe.functional.transport import IdentityTransport, Transport

STEP = Path(__file__).resolve().parents[2] / "lrmoe" / "functional" / "expert_step.py"


def _problem(T=24, D=8, F=12, E=4, K=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(E, 2 * F, D, generator=gen, dtype=torch.float64, requires_grad=True)
    down = torch.randn(E, D, F, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    gates = torch.rand(T, K, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, gate_up, down, ids, gates


def _run(transport: Transport, kernels: str, retain: float):
    x, gate_up, down, ids, gates = _problem()
    opts = BackwardOptions(retain=retain, selection="top")
    plan = plan_experts(ids, gate_up.shape[0], backward=opts)
    cfg = StepConfig(dense=retain >= 1.0, metric=opts.metric, selection=opts.selection, generator=None,
                     max_rows=retained_rows_bound(ids.numel(), gate_up.shape[0], retain), kernels=kernels)
    out = selective_step(x, gate_up, down, gates, ids.reshape(-1), plan.quotas, plan.uniform, None, cfg, transport)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad(out, (x, gate_up, down, gates), g)]


@dataclasses.dataclass(frozen=True)
class _CountingKernels(ExpertKernels):
    """A backend that records which of its methods the step called, then runs the portable one."""

    calls: list = dataclasses.field(default_factory=list, hash=False, compare=False)

    def gate_up(self, *args):
        self.calls.append("gate_up")
        return PortableKernels().gate_up(*args)

    def down(self, *args):
        self.calls.append("down")
        return PortableKernels().down(*args)

    def backward(self, *args, **kwargs):
        self.calls.append("backward")
        return PortableKernels().backward(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _RecordingTransport(IdentityTransport):
    """One device, recording what crosses the seam."""

    seen: list = dataclasses.field(default_factory=list, hash=False, compare=False)

    def dispatch(self, *args):
        out = super().dispatch(*args)
        self.seen.append(type(out).__name__)
        return out

    def combine(self, *args):
        out = super().combine(*args)
        self.seen.append(type(out).__name__)
        return out

    def exchange(self, request):
        self.seen.append(type(request).__name__)
        out = super().exchange(request)
        self.seen.append(type(out).__name__)
        return out


@pytest.mark.parametrize("retain", [1.0, 0.5])
def test_a_new_backend_and_transport_plug_in_and_give_the_portable_results(retain, monkeypatch):
    counting = _CountingKernels()
    monkeypatch.setitem(BACKENDS, "counting", counting)
    recording = _RecordingTransport()
    got = _run(recording, "counting", retain)
    want = _run(IdentityTransport(), "portable", retain)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counting.calls == ["gate_up", "down", "backward"]
    assert recording.seen == ["Dispatched", "Combined", "BackwardRequest", "Exchanged"]
    assert want[2].abs().sum() > 0  # the weights got a gradient: the comparison is not of zeros


def test_the_step_branches_on_neither_seam():
    """No isinstance or type test and no flag of a concrete transport or backend in the step's code."""
    tree = ast.parse(STEP.read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "isinstance" not in calls and "type" not in calls
    assert not {"identity", "AllToAllTransport", "PortableKernels"} & (names | attrs)


def test_a_transport_or_backend_must_implement_the_whole_interface():
    class Partial(Transport):
        selects_in_dispatch_order = True
        always_needs_dx = False

        def dispatch(self, *args):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    with pytest.raises(TypeError, match="abstract"):
        type("NoBackward", (ExpertKernels,), {"gate_up": lambda *a: None, "down": lambda *a: None})()


def test_an_unknown_backend_name_is_refused_by_name():
    assert isinstance(lookup("portable"), PortableKernels)
    with pytest.raises(ValueError, match=r"kernels must be one of \['hopper', 'portable'\], got 'cutlass'"):
        lookup("cutlass")
    assert expert_kernels.BACKENDS is BACKENDS
