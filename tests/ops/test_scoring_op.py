"""lrmoe::score_pairs: torch.library.opcheck, the Triton kernel against the reference (in Triton's interpreter
on machines without a GPU, compiled on a GPU), and torch.compile(fullgraph=True) of the functional entry point.
"""

from __future__ import annotations

import pytest
import torch

from lrmoe.functional import score_pairs as score_pairs_fn
from lrmoe.ops import score_pairs
from lrmoe.ops._kernels import kernel_module
from lrmoe.ops.scoring import score_pairs_reference

METRICS = ["lrm", "grad_l2", "grad_abs"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run the kernel in the interpreter


def _inputs(T, K, D, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gates = torch.rand(T, K, generator=g)
    grad = torch.randn(T, D, generator=g)
    phi = torch.rand(T, K, generator=g) * 4
    return gates.to(device, dtype), grad.to(device, dtype), phi.to(device)  # phi_sq is fp32, as experts save it


def _poison(gates, grad, phi, seed):
    """Put NaN / +inf / -inf into a few entries of each input (in place)."""
    g = torch.Generator().manual_seed(seed)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for t in (gates, grad, phi):
        flat = t.view(-1)
        n = max(1, flat.numel() // 5)
        idx = torch.randint(0, flat.numel(), (n,), generator=g)
        flat[idx.to(t.device)] = bad[torch.randint(0, 3, (n,), generator=g)].to(t.device, t.dtype)


# ------------------------------------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 3, 7), (1, 1, 1), (0, 2, 4)])
def test_opcheck(shape, dtype, metric):
    gates, grad, phi = _inputs(*shape, dtype=dtype)
    torch.library.opcheck(score_pairs, (gates, grad, phi, metric))


@pytest.mark.parametrize("metric", METRICS)
def test_opcheck_inputs_requiring_grad(metric):
    gates, grad, phi = (t.requires_grad_() for t in _inputs(4, 2, 6))
    torch.library.opcheck(score_pairs, (gates, grad, phi, metric))
    out = score_pairs(gates, grad, phi, metric)
    assert not out.requires_grad  # marked non-differentiable: scores only decide what the backward keeps


def test_op_rejects_random_and_unknown_metrics():
    gates, grad, phi = _inputs(2, 2, 3)
    for metric in ("random", "l1"):
        with pytest.raises(ValueError, match="metric"):
            score_pairs(gates, grad, phi, metric)


# ----------------------------------------------------------------------------------- Triton kernel vs reference


# The interpreter evaluates with NumPy, which warns on the NaN/inf/overflow these tests inject on purpose.
numpy_float_warnings = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    return kernel_module("scoring")


@numpy_float_warnings
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [7, 64, 130])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("T", [1, 5, 17])
def test_triton_equals_reference(kernels, T, K, D, dtype):
    seed = T * 1000 + K * 100 + D
    for poisoned in (False, True):
        gates, grad, phi = _inputs(T, K, D, dtype=dtype, seed=seed, device=DEVICE)
        if poisoned:
            _poison(gates, grad, phi, seed)
        for metric in METRICS:
            got = kernels.score_pairs_triton(gates, grad, phi, metric)
            want = score_pairs_reference(gates, grad, phi, metric)
            assert got.dtype == torch.float32 and got.shape == (T, K)
            assert torch.equal(got == float("inf"), want == float("inf")), (metric, poisoned)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)  # sums differ only in order


@numpy_float_warnings
def test_triton_overflow_and_strided_gradient(kernels):
    # Pair 0 overflows in the product; token 1's ||g||^2 overflows in fp32 while ||g||_1 does not, which the
    # reference also turns into +inf for grad_abs. g is a transposed (non-contiguous) view.
    gates = torch.tensor([[1e20, 1.0], [0.5, 0.25]], device=DEVICE)
    grad = torch.tensor([[1e10, 1e25], [0.0, 1.0], [3.0, 2.0]], device=DEVICE).t()
    phi = torch.tensor([[1.0, 2.0], [1.0, 1.0]], device=DEVICE)
    for metric in METRICS:
        got = kernels.score_pairs_triton(gates, grad, phi, metric)
        torch.testing.assert_close(got, score_pairs_reference(gates, grad, phi, metric), rtol=1e-6, atol=0)
        assert torch.isinf(got[1]).all()


def test_cuda_kernel_broadcasts_phi_as_the_reference_does(kernels):
    # The op's CPU reference broadcasts a [T, 1] ||phi||^2 over the K pairs; its CUDA kernel read it with its own
    # strides, past each row. Called here on the interpreter's CPU tensors where there is no GPU.
    from lrmoe.ops._kernels import INLINED

    score_pairs_cuda = INLINED["lrmoe::score_pairs"][0]  # the op's CUDA kernel
    gates, grad, phi = _inputs(5, 3, 16, device=DEVICE)
    phi_T1 = phi[:, :1].contiguous()
    for metric in METRICS:
        got = score_pairs_cuda(gates, grad, phi_T1, metric)
        torch.testing.assert_close(got, score_pairs_reference(gates, grad, phi_T1, metric), rtol=1e-5, atol=0)


def test_triton_empty(kernels):
    for T, K, D in [(0, 3, 5), (4, 0, 5), (3, 2, 0)]:
        gates, grad, phi = _inputs(T, K, D, device=DEVICE)
        got = kernels.score_pairs_triton(gates, grad, phi, "lrm")
        torch.testing.assert_close(got, score_pairs_reference(gates, grad, phi, "lrm"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("metric", METRICS)
def test_cuda_op_equals_cpu_reference(metric):
    gates, grad, phi = _inputs(300, 8, 2048, dtype=torch.bfloat16, seed=3)
    got = score_pairs(gates.cuda(), grad.cuda(), phi.cuda(), metric)
    torch.testing.assert_close(got.cpu(), score_pairs_reference(gates, grad, phi, metric), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------ torch.compile


@pytest.mark.parametrize("metric", METRICS)
def test_compiled_functional_is_one_op_and_equals_eager(metric):
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    gates, grad, phi = _inputs(6, 3, 10, dtype=torch.bfloat16, seed=1)
    gates.requires_grad_()  # the functional wrapper detaches: scores are not differentiated
    _poison(gates.data, grad, phi, seed=1)

    def f(a, g, p):
        return score_pairs_fn(a, g, p, metric=metric)

    want = f(gates, grad, phi)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(gates, grad, phi), want, rtol=0, atol=0)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend=capture)(gates, grad, phi), want)
    (gm,) = graphs
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not torch.Tensor.detach]
    assert calls == [torch.ops.lrmoe.score_pairs.default], calls
