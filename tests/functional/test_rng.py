"""lrmoe/functional/rng.py: counter-based uniforms for exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from lrmoe.functional.rng import counter_uniform


def _t(v):
    return torch.tensor(v, dtype=torch.int64)


def test_pure_function_of_seed_step_stream():
    a = counter_uniform(_t(123), _t(7), 1000, stream=2)
    b = counter_uniform(_t(123), _t(7), 1000, stream=2)
    assert torch.equal(a, b)
    for other in (counter_uniform(_t(124), _t(7), 1000, stream=2), counter_uniform(_t(123), _t(8), 1000, stream=2),
                  counter_uniform(_t(123), _t(7), 1000, stream=3), counter_uniform(_t(123 + (1 << 32)), _t(7), 1000,
                                                                                   stream=2)):
        # independent draws agree on about none of their 24-bit values
        assert (other == a).float().mean() < 0.01


def test_prefix_stable_in_n():
    # the i-th draw does not depend on how many are drawn (a step's draws stay put when the group count changes)
    assert torch.equal(counter_uniform(_t(5), _t(1), 10), counter_uniform(_t(5), _t(1), 100)[:10])


def test_range_and_uniformity():
    u = counter_uniform(_t(-987654321), _t(3), 200_000)
    assert u.dtype == torch.float32 and u.shape == (200_000,)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # chi-square over 50 bins: 49 degrees of freedom, mean 49, sd ~9.9; 120 is far past any p-value worth worrying
    counts = torch.histc(u, bins=50, min=0.0, max=1.0)
    expected = u.numel() / 50
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 120, chi2
    # consecutive draws uncorrelated
    corr = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(corr)) < 0.01
    # across steps: the per-index draws of step s and s+1 uncorrelated too
    v = counter_uniform(_t(-987654321), _t(4), 200_000)
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.01


def test_mean_of_many_steps_per_index():
    # each index's draws over steps are uniform too (systematic sampling uses one draw per group per step)
    draws = torch.stack([counter_uniform(_t(42), _t(s), 8) for s in range(4000)])
    assert torch.allclose(draws.mean(0), torch.full((8,), 0.5), atol=4 * math.sqrt(1 / 12 / 4000))


@pytest.mark.parametrize("bad", [{"n": -1}, {"n": 2.0}, {"stream": -1}, {"stream": True}])
def test_bad_sizes(bad):
    kwargs = {"n": 4, "stream": 0} | bad
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        counter_uniform(_t(1), _t(1), **kwargs)


@pytest.mark.parametrize("which", ["seed", "step"])
def test_bad_counters(which):
    args = {"seed": _t(1), "step": _t(1)}
    args[which] = torch.tensor([1, 2])
    with pytest.raises(TypeError, match=which):
        counter_uniform(args["seed"], args["step"], 4)
    args[which] = torch.tensor(1.0)
    with pytest.raises(TypeError, match=which):
        counter_uniform(args["seed"], args["step"], 4)


def test_compiles_without_graph_breaks_or_recompiles():
    torch._dynamo.reset()
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    f = torch.compile(lambda seed, step: counter_uniform(seed, step, 16, stream=1), backend=backend, fullgraph=True)
    for s in range(3):  # new counter values reuse the graph: the values are tensor data, not constants
        assert torch.equal(f(_t(9), _t(s)), counter_uniform(_t(9), _t(s), 16, stream=1))
    assert len(calls) == 1
