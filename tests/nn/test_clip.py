"""lrmoe.nn.clip_grad_norm_ on plain tensors is torch's clip_grad_norm_ (the several-mesh case, FSDP2 beside
expert parallelism, is in test_expert_parallel_fsdp.py)."""

from __future__ import annotations

import pytest
import torch

from lrmoe.nn import clip_grad_norm_


def _params(seed, scale):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((3, 4), (5,), (0, 2), (2, 2))]
    for p in params[:-1]:  # the last one has no gradient and is not counted
        p.grad = scale * torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clips / does not
def test_equals_torch_on_plain_tensors(norm_type, max_norm):
    ours, theirs = _params(0, 2.0), _params(0, 2.0)
    total = clip_grad_norm_(ours, max_norm, norm_type)
    if norm_type == float("inf"):  # torch's inf norm raises on an empty gradient, which adds nothing to the max
        theirs[2].grad = None
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert (total > max_norm) == (max_norm == 0.5)  # both cases ran


def test_non_finite_norm_raises_when_asked():
    params = _params(1, 1.0)
    params[0].grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert torch.isinf(clip_grad_norm_(_params(1, 1.0)[:1] + [params[0]], 1.0))


def test_no_gradients_gives_zero():
    p = torch.nn.Parameter(torch.ones(3))
    assert clip_grad_norm_([p], 1.0).item() == 0.0 and p.grad is None


def _expert_parallel_mix(rank, world):
    # Expert parallelism alone: DTensor expert shards beside the plain router, whose gradient the caller has
    # reduced (identical on every rank, so counted once).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lrmoe.nn import ExpertParallel, LRMoE

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layer = parallelize_module(LRMoE(8, 6, 4, 2, retain=0.5, selection="top"), mesh, ExpertParallel())
    torch.manual_seed(rank)
    layer(torch.randn(6, 8)).square().sum().backward()
    dist.all_reduce(layer.gate.weight.grad)
    full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in layer.parameters()]
    assert len(full) == 3
    want = torch.linalg.vector_norm(torch.stack([g.norm() for g in full]))
    total = clip_grad_norm_(layer.parameters(), float(want) / 2)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for p, g in zip(layer.parameters(), full):
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(got, g * (float(want) / 2) / (float(want) + 1e-6), rtol=1e-6, atol=1e-9)


def test_expert_shards_beside_a_plain_router_on_two_ranks():
    from ep_harness import run_ranks

    run_ranks(2, _expert_parallel_mix)


def _partial_gradients(rank, world):
    for norm_type in (2.0, float("inf")):
        _partial_gradients_case(rank, world, norm_type)


def _partial_gradients_case(rank, world, norm_type):
    # Unreduced gradients (Partial), as tensor parallelism can leave them: the norm is that of their sum.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    local = torch.randn(3, 4, generator=g) * (1 + 3 * rank)
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(3, 4), mesh, [Replicate()]))
    p.grad = DTensor.from_local(local, mesh, [Partial()])
    summed = local.clone()
    dist.all_reduce(summed)
    want = torch.linalg.vector_norm(summed, norm_type)
    total = clip_grad_norm_([p], float(want) / 2, norm_type)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    assert p.grad.placements[0].is_replicate()  # reduced in place of the Partial gradient, then scaled
    torch.testing.assert_close(p.grad.full_tensor(), summed * (float(want) / 2) / (float(want) + 1e-6),
                               rtol=1e-6, atol=1e-9)


def test_partial_gradients_are_reduced_first():
    """Norms 2 and inf."""
    from ep_harness import run_ranks

    run_ranks(2, _partial_gradients)


@pytest.mark.parametrize("norm_type", [0.0, -1.0, float("-inf")])
def test_orders_that_are_not_norms_are_refused(norm_type):
    with pytest.raises(ValueError, match="norm_type must be a p-norm order p > 0 or inf"):
        clip_grad_norm_(_params(0, 1.0), 1.0, norm_type)
