"""Checking mode (``lrmoe.checks``, ``LRMOE_CHECK=1``): the functional primitives' data-dependent contracts, which
the sync-free fast path leaves to the caller, refused with a ValueError naming the argument (the standing suite;
docs/reliability.md). Off by default; never traced by torch.compile.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.util
import sys
import threading

import pytest
import torch

import lrmoe
from lrmoe.functional import (
    apportion,
    balanced_capacity,
    compact_and_gemm,
    inclusion_probabilities,
    instance_experts,
    place_hot_replicas,
    plan_experts,
    plan_quotas,
    route_to_replicas,
    route_topk,
    select_within_quota,
    selective_swiglu_experts,
)
from lrmoe.functional import _checks as _checks_module
from lrmoe.functional._checks import checking

S5, G5, Q2 = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7]), torch.tensor([0, 1, 0, 1, 1]), torch.tensor([1, 2])
X, W = torch.randn(3, 2), torch.randn(2, 4, 2)  # compact_and_gemm: N = 3 rows, E = 2 experts
ROWS = torch.tensor([0, 1, 2, 1])


@pytest.fixture(autouse=True)
def checking_off_around_each_test(monkeypatch):
    """Each test starts with checking off in every context, new threads' included, whatever LRMOE_CHECK says: the
    module's context variable is replaced by a fresh one whose default is off."""
    monkeypatch.setattr(_checks_module, "_CHECKING", contextvars.ContextVar("lrmoe_checking", default=False))
    monkeypatch.setattr(_checks_module, "_BLOCKS", contextvars.ContextVar("lrmoe_checks_blocks", default=()))
    yield


# (id, call, a pattern naming the argument and the contract)
VIOLATIONS = [
    ("negative load", lambda: plan_quotas(torch.tensor([3, -1, 2]), 0.5), r"loads_SE must be >= 0 .* got -1"),
    ("negative load [S, G]", lambda: plan_quotas(torch.tensor([[3, 1], [2, -4]]), 0.5), r"loads_SE .* index \(1, 1\)"),
    ("negative capacity", lambda: plan_quotas(torch.tensor([3, 1]), 0.5, capacity=torch.tensor([2, -1])),
     "capacity must be >= 0"),
    ("placement >= W", lambda: plan_quotas(torch.tensor([3, 1, 2]), 0.5, capacity=torch.tensor([4, 4]),
                                           placement=torch.tensor([0, 2, 1])), r"placement must be in \[0, 2\)"),
    ("negative weight", lambda: apportion(torch.tensor([3]), torch.tensor([[1], [-1]])), "weights_SG must be >= 0"),
    ("negative total", lambda: apportion(torch.tensor([-3]), torch.tensor([[1], [1]])), "total_G must be >= 0"),
    ("group id >= G", lambda: select_within_quota(S5, torch.tensor([0, 1, 2, 1, 1]), Q2, max_rows=4),
     r"group_ids_P must be in \[0, 2\) .* from 0 to 2"),
    ("negative group id", lambda: select_within_quota(S5, torch.tensor([0, -1, 0, 1, 1]), Q2, max_rows=4),
     r"group_ids_P must be in \[0, 2\)"),
    ("uniform >= 1", lambda: select_within_quota(S5, G5, Q2, max_rows=4, uniform_G=torch.tensor([0.5, 1.5])),
     r"uniform_G must be in \[0, 1\)"),
    ("uniform nan", lambda: select_within_quota(S5, G5, Q2, max_rows=4, uniform_G=torch.tensor([0.5, float("nan")])),
     r"uniform_G must be in \[0, 1\)"),
    ("group order", lambda: select_within_quota(S5, G5, Q2, max_rows=4, group_order_P=torch.arange(5)),
     "group_order_P must be the stable ascending argsort"),
    ("max group size", lambda: select_within_quota(S5, G5, Q2, max_rows=4, max_group_size=2),
     "max_group_size=2 is below the largest group, 3 pairs"),
    ("group ends", lambda: select_within_quota(S5, G5, Q2, max_rows=4, group_ends_G=torch.tensor([3, 5])),
     r"group_ends_G must be the cumulative group sizes \[2, 5\]"),
    ("inclusion group id", lambda: inclusion_probabilities(S5, torch.tensor([0, 1, 0, 1, 7]), Q2),
     r"group_ids_P must be in \[0, 2\)"),
    ("negative count", lambda: route_to_replicas(torch.tensor([[1, -2], [0, 1]]), torch.ones(2, 2, dtype=torch.long)),
     "counts_SE must be >= 0"),
    ("negative instance capacity", lambda: route_to_replicas(torch.ones(2, 2, dtype=torch.long),
                                                             torch.tensor([[2, -1], [2, 2]])),
     "capacity_EW must be >= 0"),
    ("expert without instance", lambda: route_to_replicas(torch.ones(2, 2, dtype=torch.long),
                                                          torch.tensor([[2, 2], [0, 0]])),
     r"capacity_EW gives experts \[1\] no instance"),
    ("negative rank load", lambda: place_hot_replicas(torch.tensor([[1, -1], [0, 2]]), 1), "loads_WE must be >= 0"),
    ("replica id >= E", lambda: instance_experts(torch.tensor([[4], [-1]]), 4), r"replicas_WR must be in \[-1, 4\)"),
    ("replica of an owned expert", lambda: instance_experts(torch.tensor([[1], [-1]]), 4),
     r"replicas_WR puts an expert twice on ranks \[0\]"),
    ("instance id >= E", lambda: balanced_capacity(torch.tensor([2, 0, 5, 7]), torch.tensor([[0, 1, 9], [2, 3, -1]])),
     r"experts_WI must be in \[-1, 4\)"),
    ("negative expert load", lambda: balanced_capacity(torch.tensor([2, 0, -5, 7]), torch.tensor([[0, 1], [2, 3]])),
     "loads_E must be >= 0"),
    ("decreasing offsets", lambda: compact_and_gemm(X, W, ROWS, torch.tensor([3, 2])),
     "offsets_E must be nondecreasing .* got 3 then 2"),
    ("negative offset", lambda: compact_and_gemm(X, W, ROWS, torch.tensor([-1, 2])), "offsets_E must be >= 0"),
    ("row >= N", lambda: compact_and_gemm(X, W, torch.tensor([0, 3, 2, 1]), torch.tensor([1, 3])),
     r"rows_R must be in \[0, 3\)"),
    ("nan selection bias", lambda: route_topk(torch.randn(3, 4), 2, bias_E=torch.tensor([0.0, float("nan"), 0, 0])),
     "bias_E must be finite"),
]


@pytest.mark.parametrize("call, match", [case[1:] for case in VIOLATIONS], ids=[case[0] for case in VIOLATIONS])
def test_checking_mode_refuses_a_contract_violation_naming_the_argument(call, match):
    with lrmoe.checks():
        with pytest.raises(ValueError, match=match):
            call()


def test_the_fast_path_keeps_its_documented_results_for_what_it_cannot_check():
    """Checking off: a negative load counts as 0, rows past offsets_E[-1] are ignored, ends past R are clipped."""
    assert torch.equal(plan_quotas(torch.tensor([3, -1, 2]), 0.5), plan_quotas(torch.tensor([3, 0, 2]), 0.5))
    y = compact_and_gemm(X, W, torch.tensor([0, 2, -1, 99]), torch.tensor([1, 2]))
    torch.testing.assert_close(y[1], W[1] @ X[2])
    assert (y[2:] == 0).all()
    with lrmoe.checks():  # the same calls are within contract: checking does not refuse them
        y_checked = compact_and_gemm(X, W, torch.tensor([0, 2, -1, 99]), torch.tensor([1, 2]))
        assert torch.equal(y_checked, y)
        assert torch.equal(compact_and_gemm(X, W, ROWS, torch.tensor([2, 9])),
                           compact_and_gemm(X, W, ROWS, torch.tensor([2, 4])))  # an end past R = 4 is clipped


def test_checks_is_a_block_that_restores_the_previous_setting():
    assert not checking()
    block = lrmoe.checks()
    with block:
        assert checking()
        with lrmoe.checks(False):
            assert not checking()
            with block:  # the same object entered again inside its own block
                assert checking()
            assert not checking()
        assert checking()
    assert not checking()
    with pytest.raises(RuntimeError, match="inside"), lrmoe.checks():  # left by an exception: restored too
        raise RuntimeError("inside")
    assert not checking()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        lrmoe.checks("yes")


def test_checks_without_with_changes_nothing():
    lrmoe.checks()
    lrmoe.checks(True)
    assert not checking()
    with lrmoe.checks():
        lrmoe.checks(False)
        assert checking()
    assert not checking()


def test_the_setting_belongs_to_the_context_that_runs_the_block():
    """A block sets checking for its own context: a thread started inside it has a context of its own, which sees
    the setting outside every block (a Python that passes the context to new threads: the block's); a copy of the
    block's context sees the block's."""
    inherits = bool(getattr(sys.flags, "thread_inherit_context", False))  # Python 3.14+, free-threaded by default
    seen = []
    with lrmoe.checks():
        worker = threading.Thread(target=lambda: seen.append(checking()))
        worker.start()
        worker.join()
        assert contextvars.copy_context().run(checking)
        assert checking()
    assert seen == [inherits]
    assert not checking()


def test_a_checks_object_entered_on_two_threads_at_once_restores_each():
    """One checks object, its blocks open on two threads at once and closed in the other order: each thread gets
    its own setting back (a block leaves by the token of its own context)."""
    block = lrmoe.checks()
    entered, leave_first = threading.Barrier(2), threading.Event()
    seen = {}

    def run(name, first):
        try:
            with block:
                entered.wait(timeout=30)
                if not first:
                    leave_first.wait(timeout=30)
            seen[name] = checking()
        except Exception as error:  # noqa: BLE001 - handed back to the test
            seen[name] = error
        finally:
            if first:
                leave_first.set()

    workers = [threading.Thread(target=run, args=(name, first)) for name, first in (("a", True), ("b", False))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert seen == {"a": False, "b": False}


E_STEP, T_STEP, K_STEP, D_STEP, F_STEP = 4, 6, 2, 8, 4


def _step_loss_with_out_of_contract_uniforms(experts=selective_swiglu_experts):
    """A selective step (retain 0.5, "sample") whose plan's uniforms are 1.5, outside [0, 1): the forward reads no
    uniform, and the backward's selection clamps them on the fast path (it runs) and refuses them under checking
    (``uniform_G must be in [0, 1)``). Returns the loss, the gradient's leaf."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T_STEP, D_STEP, generator=gen, requires_grad=True)
    gate_up = torch.randn(E_STEP, 2 * F_STEP, D_STEP, generator=gen, requires_grad=True)
    down = torch.randn(E_STEP, D_STEP, F_STEP, generator=gen, requires_grad=True)
    ids = torch.stack([torch.randperm(E_STEP, generator=gen)[:K_STEP] for _ in range(T_STEP)])
    gates = torch.rand(T_STEP, K_STEP, generator=gen)
    plan = dataclasses.replace(plan_experts(ids, E_STEP, retain=0.5, selection="sample"),
                               uniform=torch.full((E_STEP,), 1.5))
    out = experts(x, gate_up, down, ids, gates, plan=plan, retain=0.5, selection="sample")
    return out.square().sum(), x


def _backward_on_a_new_thread(loss):
    """loss.backward() on a plain new thread, as autograd runs the backward of CUDA tensors: a context of its own.
    Returns the exception the backward raised, or None."""
    raised = []

    def run():
        try:
            loss.backward()
        except Exception as error:  # noqa: BLE001 - handed back to the test
            raised.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return raised[0] if raised else None


def test_the_out_of_contract_step_runs_unchecked_and_is_refused_checked():
    """The step these tests use: its backward runs on the fast path and is refused when forward and backward run
    in one block."""
    loss, x = _step_loss_with_out_of_contract_uniforms()
    loss.backward()
    assert x.grad is not None and x.grad.isfinite().all()
    with lrmoe.checks():
        loss, _ = _step_loss_with_out_of_contract_uniforms()
        with pytest.raises(ValueError, match=r"uniform_G must be in \[0, 1\)"):
            loss.backward()


def test_a_forward_inside_a_block_has_its_backward_checked_after_the_block():
    with lrmoe.checks():
        loss, _ = _step_loss_with_out_of_contract_uniforms()
    assert not checking()
    with pytest.raises(ValueError, match=r"uniform_G must be in \[0, 1\)"):
        loss.backward()


def test_a_forward_inside_a_block_has_its_backward_checked_on_another_thread():
    with lrmoe.checks():
        loss, _ = _step_loss_with_out_of_contract_uniforms()
        error = _backward_on_a_new_thread(loss)  # inside the block too: the new thread's context is not the block's
    assert isinstance(error, ValueError) and "uniform_G must be in [0, 1)" in str(error)
    loss, _ = _step_loss_with_out_of_contract_uniforms()  # and from outside it, the forward's block long gone
    with lrmoe.checks():
        loss, _ = _step_loss_with_out_of_contract_uniforms()
    error = _backward_on_a_new_thread(loss)
    assert isinstance(error, ValueError) and "uniform_G must be in [0, 1)" in str(error)


def test_a_forward_outside_every_block_has_no_check_in_its_backward_inside_one():
    loss, x = _step_loss_with_out_of_contract_uniforms()
    with lrmoe.checks():
        loss.backward()  # the forward ran unchecked: so does its backward
    assert x.grad is not None and x.grad.isfinite().all()
    loss, x = _step_loss_with_out_of_contract_uniforms()
    with lrmoe.checks():
        assert _backward_on_a_new_thread(loss) is None
    assert x.grad is not None and x.grad.isfinite().all()


def test_checking_compiles_whole_inside_and_outside_a_block():
    """checking() reads the context variable only outside torch.compile's tracing: a function branching on it
    traces whole (fullgraph), and compiled it never checks."""

    def f(x):
        return x + 1 if checking() else x - 1

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.zeros(2)
    with lrmoe.checks():
        assert torch.equal(compiled(x), x - 1)
        assert torch.equal(f(x), x + 1)
    assert torch.equal(compiled(x), x - 1)


def test_a_compiled_step_traces_whole_in_a_block_and_its_backward_checks_nothing():
    """The selective step compiled whole (fullgraph: its forward records the setting, its backward sets it, neither
    traced) inside a block: forward and backward run, the out-of-contract uniforms unchecked, as compiled code
    never checks."""
    compiled = torch.compile(selective_swiglu_experts, fullgraph=True, backend="aot_eager")
    with lrmoe.checks():
        loss, x = _step_loss_with_out_of_contract_uniforms(compiled)
        loss.backward()
    assert x.grad is not None and x.grad.isfinite().all()


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False), (None, False)])
def test_the_environment_variable_sets_the_initial_mode(value, on, monkeypatch):
    """LRMOE_CHECK is read when the module loads: a fresh copy of lrmoe.functional._checks, loaded under each
    value, starts checking or not (a fresh interpreter would take ~10 s to import torch for the same answer)."""
    if value is None:
        monkeypatch.delenv("LRMOE_CHECK", raising=False)
    else:
        monkeypatch.setenv("LRMOE_CHECK", value)
    spec = importlib.util.spec_from_file_location("fresh_checks", _checks_module.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.checking() is on


def test_compiled_graphs_are_the_same_with_checking_on_and_trace_no_check():
    """fullgraph compiles with checking on or off (a check that synced would break the graph); the checks run in
    eager code only, so a compiled call given an out-of-contract load computes as the fast path does."""

    def plan_and_gemm(loads_E, offsets_E):
        quotas_E = plan_quotas(loads_E, 0.5)
        return quotas_E, compact_and_gemm(X, W, ROWS, offsets_E)

    compiled = torch.compile(plan_and_gemm, fullgraph=True, backend="eager")
    loads, offsets = torch.tensor([3, -1, 2]), torch.tensor([1, 3])
    want = plan_and_gemm(loads, offsets)
    with lrmoe.checks():
        got = compiled(loads, offsets)
        with pytest.raises(ValueError, match="loads_SE"):
            plan_and_gemm(loads, offsets)  # eager: checked
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got_off = compiled(loads, offsets)
    assert torch.equal(got_off[0], want[0])
