"""Tests of the named placement-policy table of lrmoe/functional/expert_parallel.py and the plan it feeds, which
need no process group (the planner's properties are in tests/nn/test_expert_parallel*.py, beside the layer)."""

from __future__ import annotations

import pytest
import torch

from lrmoe.functional import place_hot_replicas
from lrmoe.functional.expert_parallel import (
    PLACEMENT_POLICIES,
    placement_policy_name,
    plan_expert_parallel,
    register_placement_policy,
)
from lrmoe.nn import ExpertParallel

LOADS_WE = torch.tensor([[9, 0, 3, 1], [4, 4, 0, 8]])  # W = 2 ranks, E = 4 experts


def _coldest(loads_WE, max_replicas):
    """Replicate each rank's least-loaded foreign expert: a policy other than the default."""
    n_ranks, n_exp = loads_WE.shape
    owner_E = torch.arange(n_exp) // (n_exp // n_ranks)
    key_WE = loads_WE.sum(0).double().expand(n_ranks, n_exp).clone()
    key_WE[owner_E.unsqueeze(0) == torch.arange(n_ranks).unsqueeze(1)] = float("inf")
    return key_WE.argsort(1)[:, :max_replicas]


@pytest.fixture
def registered():
    name = register_placement_policy("test_coldest", _coldest)
    yield name
    del PLACEMENT_POLICIES[name]


def test_a_registered_policy_is_found_by_name_and_by_function(registered):
    assert PLACEMENT_POLICIES["hot"] is place_hot_replicas  # the default, registered
    assert placement_policy_name(registered) == placement_policy_name(_coldest) == "test_coldest"
    assert placement_policy_name(place_hot_replicas) == "hot"
    assert placement_policy_name(lambda loads, r: loads) is None  # not registered: run outside the plan's op
    assert register_placement_policy("test_coldest", _coldest) == "test_coldest"  # again: a no-op
    with pytest.raises(ValueError, match="'test_coldest' is registered already"):
        register_placement_policy("test_coldest", place_hot_replicas)
    assert PLACEMENT_POLICIES["test_coldest"] is _coldest  # a name always names the same function
    with pytest.raises(ValueError, match="placement_policy 'warmest' is not registered"):
        placement_policy_name("warmest")
    with pytest.raises(TypeError, match="placement_policy must be a registered name or a callable"):
        placement_policy_name(3)
    with pytest.raises(TypeError, match="policy must be callable"):
        register_placement_policy("test_three", 3)


def test_a_policy_plans_the_same_by_name_and_as_a_function(registered):
    by_name = plan_expert_parallel(LOADS_WE, 0.5, max_replicas=1, placement_policy=registered)
    by_function = plan_expert_parallel(LOADS_WE, 0.5, max_replicas=1, placement_policy=_coldest)
    default = plan_expert_parallel(LOADS_WE, 0.5, max_replicas=1)
    for a, b in zip((by_name.instances, by_name.routes, by_name.instance_quotas),
                    (by_function.instances, by_function.routes, by_function.instance_quotas), strict=True):
        assert torch.equal(a, b)
    # Loads per expert 13, 4, 3, 9: rank 0 (owning 0-1) replicates 2 (load 3), rank 1 (owning 2-3) 1 (load 4).
    assert by_name.instances[:, 2].tolist() == [2, 1]
    assert not torch.equal(by_name.instances, default.instances)  # the policy made a difference


def test_the_op_plans_with_a_registered_policy_or_an_outside_placement(registered):
    """lrmoe::ep_plan reaches a registered policy by name; a policy that is not registered runs before the op,
    which then takes its output: the two give the same plan."""
    inside = torch.ops.lrmoe.ep_plan(LOADS_WE, None, 0.5, 0.0, "waterfill", 1, None, registered, 1)
    outside = torch.ops.lrmoe.ep_plan(LOADS_WE, _coldest(LOADS_WE, 1), 0.5, 0.0, "waterfill", 1, None, "hot", 1)
    for a, b in zip(inside, outside, strict=True):
        assert torch.equal(a, b)


def test_the_style_keeps_a_registered_policys_name(registered):
    assert ExpertParallel(max_replicas=1, placement_policy=registered).replication.placement == registered
    assert ExpertParallel(max_replicas=1, placement_policy=_coldest).replication.placement == registered
    assert ExpertParallel().replication.placement == "hot"
    unregistered = ExpertParallel(max_replicas=1, placement_policy=lambda loads, r: loads[:, :r])
    assert unregistered.replication.placement is None  # it runs before the op, in the layer's graph
