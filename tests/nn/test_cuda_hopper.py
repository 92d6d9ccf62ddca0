"""The "hopper" backend (quack's CuTe-DSL grouped GEMMs, lrmoe.ops.hopper) on an sm_90 GPU against the portable
backend: the same layer, weights and batch give the same output and, at retain 1, the same gradients (bf16
tolerances: the two sum in different orders); at retain < 1 "save", "recompute" and "offload" agree bit for bit
with each other; the compiled layer traces in one graph, equals eager, and never synchronises with the host; at
retain 1 no expert output is saved.
Skipped without such a GPU and quack (the GPU run carries quack)."""

from __future__ import annotations

import pytest
import torch

from lrmoe.functional.expert_kernels import choose_kernels
from lrmoe.nn import LRMoE
from lrmoe.ops import hopper_available

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and hopper_available(0)),
                                reason="needs an sm_90 GPU with quack-kernels installed")

D, F, E, K = 256, 128, 16, 4


def _layer(kernels: str, retain: float, activations: str = "save") -> LRMoE:
    torch.manual_seed(0)
    layer = LRMoE(D, F, E, K, retain=retain, selection="top", kernels=kernels, activations=activations)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    return layer.to("cuda", torch.bfloat16)


def _run(layer, T=512, seed=1, fn=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    g = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = (layer if fn is None else fn)(x)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], g)
    return [out.detach(), *grads]


def _close(a, b, what, rel=2e-2):
    err = (a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-6)
    assert err < rel, f"{what}: relative error {err:.3g}"


def test_hopper_runs_here_where_asked_and_auto_keeps_the_faster_portable_backend():
    x = torch.zeros(8, D, device="cuda", dtype=torch.bfloat16)
    assert choose_kernels("hopper", x, D, F, blocked=False) == "hopper"
    assert choose_kernels("auto", x, D, F, blocked=False) == "portable"
    with pytest.raises(ValueError, match="x is torch.float32"):
        choose_kernels("hopper", x.float(), D, F, blocked=False)


@pytest.mark.parametrize("T", [512, 1000])
def test_hopper_equals_portable_at_retain_1(T):
    got = _run(_layer("hopper", 1.0), T)
    want = _run(_layer("portable", 1.0), T)
    names = ["out", "x", *(n for n, _ in _layer("portable", 1.0).named_parameters())]
    for name, a, b in zip(names, got, want):
        _close(a, b, name)


@pytest.mark.parametrize("retain", [0.5, 0.3])
def test_activation_policies_agree_bit_for_bit(retain):
    ref = _run(_layer("hopper", retain, "save"))
    for act in ("recompute", "offload"):
        for a, b in zip(_run(_layer("hopper", retain, act)), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=act)
    portable = _run(_layer("portable", retain))
    _close(ref[0], portable[0], "out")


@pytest.mark.parametrize("retain", [1.0, 0.5])
def test_compiled_hopper_layer_equals_eager_without_host_syncs(retain):
    layer = _layer("hopper", retain)
    compiled = torch.compile(layer, fullgraph=True)
    eager = _run(layer)
    got = _run(layer, fn=compiled)
    for a, b in zip(got, eager):
        _close(a, b, "compiled", rel=1e-2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(layer, fn=compiled)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("retain", [1.0, 0.5])
def test_hopper_saves_y_only_below_retain_1(retain):
    """At retain 1 the hopper backward reads g's rows through the token index and returns the router gradient
    from its dgated GEMM's epilogue (lrmoe::hopper_token_rows_backward), so no [T*K, D] expert output is saved;
    below retain 1 it keeps y (it does not compute the dropped pairs' router gradient)."""
    T = 512
    layer = _layer("hopper", retain)
    shapes = []
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        out = layer(x)
    out.sum().backward()
    # h [T*K, 2F] has y's shape here (2F = D): saved once at retain 1, with y below it.
    assert 2 * F == D and shapes.count((T * K, D)) == (2 if retain < 1.0 else 1)
