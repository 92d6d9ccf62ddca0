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
