"""lrmoe_kernels.launch.known_empty: the launchers' early return for empty inputs, safe to trace when a size is an
unbacked SymInt (a row count received from other ranks, under torch.compile)."""

from __future__ import annotations

import pytest
import torch
from lrmoe_kernels.launch import known_empty
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode


def test_known_empty_on_plain_sizes():
    assert known_empty(0)
    assert known_empty(5, 0)
    assert not known_empty(5, 3)
    assert not known_empty()


# A launcher traced under torch.compile sees fake tensors, as an op's fake implementation does: this op's fake
# applies a test to its input's row count, which the compiled function below makes an unbacked SymInt.
_SEEN: list[bool] = []
_TESTS = {"known_empty": lambda n: known_empty(n), "== 0": lambda n: bool(n == 0)}
_TEST = {"name": "known_empty"}


@torch.library.custom_op("lrmoe_test::rows_sum", mutates_args=())
def _rows_sum(x_ND: torch.Tensor) -> torch.Tensor:
    return x_ND.sum()


@_rows_sum.register_fake
def _(x_ND):
    _SEEN.append(_TESTS[_TEST["name"]](x_ND.shape[0]))
    return x_ND.new_empty(())


def _compile_with_unbacked_rows(test_name: str) -> torch.Tensor:
    _TEST["name"] = test_name

    def f(x_ND, n_rows):
        n = n_rows.item()
        torch._check(n >= 0)
        return _rows_sum(x_ND.new_ones(n, x_ND.shape[1]))

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        return torch.compile(f, fullgraph=True, backend="aot_eager")(torch.ones(6, 4), torch.tensor(3))


def test_known_empty_does_not_guard_on_an_unbacked_size():
    _SEEN.clear()
    assert _compile_with_unbacked_rows("known_empty").item() == 12.0
    assert _SEEN and not any(_SEEN)  # traced as "not known to be empty": the launch would go ahead
    # The plain test it replaces fails that compile: this is what broke the expert-parallel layer on CUDA.
    with pytest.raises(Exception) as failure:
        _compile_with_unbacked_rows("== 0")
    chain, e = [], failure.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(c, GuardOnDataDependentSymNode) for c in chain) or "data-dependent" in str(failure.value)
