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
from lrmoe.functional.transport import IdentityTransport, Transport
from step_case import run_step

STEP = Path(__file__).resolve().parents[2] / "lrmoe" / "functional" / "expert_step.py"


@dataclasses.dataclass(frozen=True)
class _CountingKernels(ExpertKernels):
    """A backend that records which of its methods the step called, then runs the portable one."""

    calls: list = dataclasses.field(default_factory=list, hash=False, compare=False)
    computes_router_gradient = PortableKernels.computes_router_gradient
    computes_dropped_router_gradient = PortableKernels.computes_dropped_router_gradient

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
    got = run_step("counting", retain, transport=recording)
    want = run_step("portable", retain)
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


@dataclasses.dataclass(frozen=True)
class _DyRowsKernels(ExpertKernels):
    """A backend that does not compute the router gradient: it takes dy rows, as the expert-parallel step sends
    them, and records what the backward was handed."""

    seen: list = dataclasses.field(default_factory=list, hash=False, compare=False)

    def gate_up(self, *args):
        return PortableKernels().gate_up(*args)

    def down(self, *args):
        return PortableKernels().down(*args)

    def backward(self, dy, *args, **kwargs):
        self.seen.append(type(dy).__name__)
        return PortableKernels().backward(dy, *args, **kwargs)


@pytest.mark.parametrize("retain", [1.0, 0.5])
@pytest.mark.parametrize("activations", ["save", "recompute", "offload"])
def test_the_router_gradient_from_the_backward_equals_the_one_from_the_saved_output(retain, activations,
                                                                                     monkeypatch):
    """On one device the portable backend takes the rows as token rows and returns <g_t, y_u> from its own operands
    (<g_t W_down^T, phi_u>): at retain 1, and below it for the dropped pairs too, from their own g W_down^T and phi
    (of the saved h, or saved itself when h is not). A backend that does not compute the router gradient gets dy rows
    and the step reads the saved y. The two give the same output and gradients (fp64: to rounding), the gates'
    (dropped pairs' too) included."""
    dy_rows = _DyRowsKernels()
    monkeypatch.setitem(BACKENDS, "dy-rows", dy_rows)
    seen = []
    monkeypatch.setitem(BACKENDS, "portable-seen", _SeenPortable(seen))
    got = run_step("portable-seen", retain, activations=activations)
    want = run_step("dy-rows", retain, activations=activations)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert want[4].abs().sum() > 0  # the gates got a gradient
    assert dy_rows.seen == ["list"]
    assert seen == ["TokenRows"]


@dataclasses.dataclass(frozen=True)
class _SeenPortable(PortableKernels):
    seen: list = dataclasses.field(default_factory=list, hash=False, compare=False)

    def backward(self, dy, *args, **kwargs):
        self.seen.append(type(dy).__name__)
        return super().backward(dy, *args, **kwargs)


@pytest.mark.parametrize("retain", [1.0, 0.5])
def test_the_step_saves_no_expert_output(retain, monkeypatch):
    """On one device with a backend that computes the router gradient the step saves x, the weights, h and the
    routing, and no tensor of y's [T*K, D] rows; with a backend that does not, it saves y. With h recomputed it
    saves phi's [T*K, F] rows below retain 1 (the dropped pairs' router gradient reads them), none at retain 1."""
    monkeypatch.setitem(BACKENDS, "dy-rows", _DyRowsKernels())
    T, D, F, K = 24, 8, 12, 2

    def saved_shapes(kernels, activations="save"):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            run_step(kernels, retain, activations=activations, T=T, D=D, F=F, K=K)
        return shapes

    saved, recompute = saved_shapes("portable"), saved_shapes("portable", "recompute")
    assert (T * K, D) not in saved and (T * K, 2 * F) in saved and (T * K, F) not in saved
    assert (T * K, D) in saved_shapes("dy-rows")
    assert (T * K, D) not in recompute and (T * K, 2 * F) not in recompute
    assert ((T * K, F) in recompute) == (retain < 1.0)


def test_expert_parallelism_refuses_token_rows():
    """Under expert parallelism the retained rows cross ranks, so there is no source row to read in place: the
    all-to-all transport refuses a request for token rows rather than sending dy rows the backend would misread
    (the step never asks it: it does not select in dispatch order)."""
    from lrmoe.functional.transport import BackwardRequest
    from lrmoe.nn._transport import AllToAllTransport

    transport = AllToAllTransport(ep=None, splits=None)
    assert not transport.selects_in_dispatch_order
    empty = torch.zeros(0)
    request = BackwardRequest(empty, empty, empty, empty, None, None, True, None, False, token_rows=True)
    with pytest.raises(ValueError, match="AllToAllTransport sends dy rows; token_rows needs selects_in_dispatch_order"):
        transport.exchange(request)
