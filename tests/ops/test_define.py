"""lrmoe.ops._define.define_op: what each part does, on a small op of its own (namespace lrmoe_test), and that every
lrmoe op is registered through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lrmoe.ops._define import define_op
from lrmoe.ops._kernels import INLINED, kernel_module

ROOT = Path(__file__).resolve().parents[2]


def _check(x: torch.Tensor, scale: float) -> None:
    if x.dim() != 1:
        raise ValueError(f"lrmoe_test::scaled: x must be 1-D, got shape {tuple(x.shape)}")


@define_op("lrmoe_test::scaled", check=_check, fake=lambda x, scale: torch.empty_like(x), kernels="launch",
           cuda=lambda kernels, x, scale: x * scale + 1,  # "the kernel": tells its result from the reference's
           reference_if=lambda kernels, x, scale: x.dtype == torch.float64, inline=True)
def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale


@define_op("lrmoe_test::shifted", fake=lambda x, shift=None: torch.empty_like(x),
           cuda=lambda x, shift: x + (2.0 if shift is None else shift))  # the whole signature, as kernels are written
def shifted(x: torch.Tensor, shift: float | None = None) -> torch.Tensor:
    return x + (1.0 if shift is None else shift)


def test_a_cuda_kernel_gets_omitted_arguments_at_their_defaults():
    """The dispatcher hands a kernel the arguments as the op was called; the CUDA kernel of
    lrmoe::gather_sum_rows (weights_TK left out by its callers) failed on the GPU with a missing argument."""
    kernel = shifted._backend_fns["cuda"]  # the registered CUDA kernel (run here on CPU tensors)
    x = torch.zeros(3)
    assert torch.equal(kernel(x), x + 2) and torch.equal(kernel(x, 5.0), x + 5)


def test_the_reference_is_the_cpu_kernel_and_checks_run_first():
    x = torch.arange(4.0)
    assert torch.equal(scaled(x, 2.0), x * 2)
    assert "(Tensor x, float scale) -> Tensor" in str(torch.ops.lrmoe_test.scaled.default._schema)
    with pytest.raises(ValueError, match="x must be 1-D"):
        scaled(x.view(2, 2), 2.0)


def test_the_fake_checks_and_gives_the_shape():
    torch.library.opcheck(torch.ops.lrmoe_test.scaled.default, (torch.arange(4.0), 2.0))
    with pytest.raises(RuntimeError, match="x must be 1-D"):  # raised by the fake while Dynamo traces
        torch.compile(scaled, fullgraph=True, backend="eager")(torch.ones(2, 2), 2.0)


def test_outputs_are_forward_only_by_default():
    x = torch.arange(4.0, requires_grad=True)
    out = scaled(x, 2.0)
    assert not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


@pytest.mark.skipif(kernel_module("launch") is None, reason="needs Triton (without it CUDA runs the reference)")
def test_the_cuda_kernel_falls_back_to_the_reference_where_asked():
    cuda_kernel, when = INLINED["lrmoe_test::scaled"]  # the registered CUDA kernel (run here on CPU tensors)
    assert when is None
    x = torch.arange(4.0)
    assert torch.equal(cuda_kernel(x, 2.0), x * 2 + 1)
    assert torch.equal(cuda_kernel(x.double(), 2.0), x.double() * 2)  # reference_if
    with pytest.raises(ValueError, match="x must be 1-D"):
        cuda_kernel(x.view(2, 2), 2.0)


def test_every_lrmoe_op_is_registered_through_define_op():
    registering = re.compile(r"custom_op\(|\.register_(fake|kernel|autograd)\b")
    files = [path for path in (ROOT / "lrmoe").rglob("*.py") if path.name != "_define.py"]
    by_hand = [f"{path.relative_to(ROOT)}:{n}" for path in files
               for n, line in enumerate(path.read_text().splitlines(), 1) if registering.search(line)]
    assert not by_hand, by_hand
    assert sum("@define_op(" in path.read_text() for path in files) >= 9  # the op modules, found by the search
