"""lrmoe/functional/rng.py: keyed uniforms, a pure function of the step's routing."""

from __future__ import annotations

import math

import pytest
import torch

from lrmoe.functional.rng import block_routing_keys, keyed_uniform, routing_key, sampling_uniforms


def _k(v):
    return torch.tensor(v, dtype=torch.int64)


def _routing(seed, t=64, e=16, k=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]  # k distinct experts per token
    return torch.rand(t, k, generator=g), ids


def test_pure_function_of_key_and_stream():
    a = keyed_uniform(_k(123), 1000, stream=2)
    assert torch.equal(a, keyed_uniform(_k(123), 1000, stream=2))
    for other in (keyed_uniform(_k(124), 1000, stream=2), keyed_uniform(_k(123), 1000, stream=3),
                  keyed_uniform(_k(123 + (1 << 32)), 1000, stream=2)):
        assert (other == a).float().mean() < 0.01  # independent draws share about none of their 24-bit values


def test_prefix_stable_in_n():
    assert torch.equal(keyed_uniform(_k(5), 10), keyed_uniform(_k(5), 100)[:10])


def test_range_and_uniformity():
    u = keyed_uniform(_k(-987654321), 200_000)
    assert u.dtype == torch.float32 and u.shape == (200_000,)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # chi-square over 50 bins: 49 degrees of freedom (mean 49, sd ~9.9)
    counts = torch.histc(u, bins=50, min=0.0, max=1.0)
    expected = u.numel() / 50
    assert float(((counts - expected) ** 2 / expected).sum()) < 120
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


def test_routing_key_changes_with_any_expert_or_position_and_ignores_gates():
    _, ids = _routing(0)
    key = routing_key(ids)
    assert key.dtype == torch.int64 and key.dim() == 0 and 0 <= int(key) < 2**32
    assert torch.equal(routing_key(ids.clone().int()), key)  # the ids' integer dtype plays no part
    other = ids.clone()
    other[10, 2] = (other[10, 2] + 1) % 16
    swapped = ids.clone()
    swapped[3, [0, 1]] = swapped[3, [1, 0]]
    for i in (other, swapped, ids.flip(0)):
        assert not torch.equal(routing_key(i), key)


def test_draws_per_group_are_uniform_across_routings():
    # what systematic sampling sees: one draw per group per step; over many steps each group's draws are U(0, 1)
    draws = torch.stack([sampling_uniforms(_routing(s)[1], 8) for s in range(3000)])
    assert torch.allclose(draws.mean(0), torch.full((8,), 0.5), atol=4 * math.sqrt(1 / 12 / 3000))
    assert torch.allclose(draws.var(0), torch.full((8,), 1 / 12), atol=0.01)
    # and the groups' draws are uncorrelated (28 pairs, each |r| ~ N(0, 0.018): 0.08 is 4.4 standard errors)
    off_diagonal = torch.corrcoef(draws.T) - torch.eye(8)
    assert float(off_diagonal.abs().max()) < 0.08


def test_a_generator_draws_instead():
    _, ids = _routing(1)
    a = sampling_uniforms(ids, 6, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, torch.rand(6, generator=torch.Generator().manual_seed(4)))
    assert torch.equal(sampling_uniforms(ids, 6, stream=1), keyed_uniform(routing_key(ids), 6, stream=1))


def test_block_keys_are_the_routing_keys_of_each_blocks_pairs():
    # Rows sorted by expert, as a dispatcher hands them: block b's key is routing_key of that block's slice with
    # block-relative ids, what the expert-parallel rank holding the block keys its own rows with.
    ids_P = torch.randint(0, 12, (300,), generator=torch.Generator().manual_seed(2)).sort().values
    ids_P[ids_P // 4 == 1] = 8  # block 1 receives nothing: its key is that of no pairs
    keys = block_routing_keys(ids_P.unsqueeze(1), 12, 3)
    want = [routing_key(ids_P[ids_P // 4 == b].unsqueeze(1) - 4 * b) for b in range(3)]
    assert keys.dtype == torch.int64 and torch.equal(keys, torch.stack(want))
    assert int(keys[1]) == 0 and torch.equal(block_routing_keys(ids_P, 12, 1), routing_key(ids_P).view(1))
    # Ordered by block, not necessarily by expert within it: each block's pairs in their own order.
    mixed_P = torch.tensor([1, 0, 1, 3, 2, 2])
    want = [routing_key(torch.tensor([[1], [0], [1]])), routing_key(torch.tensor([[1], [0], [0]]))]
    assert torch.equal(block_routing_keys(mixed_P, 4, 2), torch.stack(want))


@pytest.mark.parametrize("ids_dtype, num_experts, blocks, error, match", [
    (torch.float32, 4, 2, TypeError, "expert_ids_P must be an integer tensor"),
    (torch.long, 4, 3, ValueError, "blocks must be a Python int >= 1 dividing num_experts=4"),
    (torch.long, 0, 1, ValueError, "num_experts must be a Python int >= 1"),
])
def test_block_keys_bad_arguments(ids_dtype, num_experts, blocks, error, match):
    with pytest.raises(error, match=match):
        block_routing_keys(torch.zeros(3, dtype=ids_dtype), num_experts, blocks)


@pytest.mark.parametrize("bad", [{"n": -1}, {"n": 2.0}, {"n": 2**31}, {"stream": -1}, {"stream": True}])
def test_bad_sizes(bad):
    kwargs = {"n": 4, "stream": 0} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        keyed_uniform(_k(1), **kwargs)


def test_bad_key():
    with pytest.raises(TypeError, match="key"):
        keyed_uniform(torch.tensor([1, 2]), 4)
    with pytest.raises(TypeError, match="key"):
        keyed_uniform(torch.tensor(1.0), 4)


def test_compiles_without_graph_breaks_or_recompiles_and_matches_eager():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda i: sampling_uniforms(i, 16, stream=1), backend=backend, fullgraph=True)
    for s in range(3):  # new routings reuse the graph: their values are tensor data
        _, ids = _routing(s)
        assert torch.equal(f(ids), sampling_uniforms(ids, 16, stream=1))
    assert len(graphs) == 1


# On a GPU, Inductor turns arithmetic on an arange into index expressions that Triton evaluates in int32: a key
# that multiplied the pair position by a 32-bit constant failed to compile there ("Scalar 2654435769 is out of
# range for type int32"), and a product over 2**31 would wrap. 40,000 tokens x 8 = 320,000 pairs: position x
# 2**15 already passes 2**31.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_inductor_draws_equal_eager_at_more_pairs_than_int32_products_allow(device):
    torch._dynamo.reset()
    ids = torch.randint(0, 128, (40_000, 8), generator=torch.Generator().manual_seed(0)).to(device)
    inductor = torch.compile(lambda i: sampling_uniforms(i, 128, stream=1), fullgraph=True)
    assert torch.equal(inductor(ids), sampling_uniforms(ids, 128, stream=1))
    assert torch.equal(torch.compile(routing_key, fullgraph=True)(ids), routing_key(ids))
    sorted_ids = ids.reshape(-1).sort().values
    blocks = torch.compile(lambda i: block_routing_keys(i, 128, 4), fullgraph=True)
    assert torch.equal(blocks(sorted_ids), block_routing_keys(sorted_ids, 128, 4))
