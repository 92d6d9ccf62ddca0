"""torch.compile(fullgraph=True) of LRMoE forward + backward on CPU gives the eager values."""

from __future__ import annotations

import pytest
import torch

from lrmoe.nn import LRMoE


@pytest.mark.parametrize("selection, activations, quota_align, backward_capacity",
                         [("top", "save", 1, None), ("sample", "save", 1, None), ("top", "recompute", 1, None),
                          ("top", "offload", 1, None), ("top", "save", 8, None), ("top", "save", 1, 2.0),
                          ("sample", "recompute", 1, 2.0)])
def test_compiled_equals_eager_at_retain_075(selection, activations, quota_align, backward_capacity, fwd_bwd):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(32, 24, 8, 2, retain=0.75, selection=selection, activations=activations,
                  quota_align=quota_align, backward_capacity=backward_capacity)
    x, c = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    compiled = torch.compile(layer, fullgraph=True)
    # Inductor draws random numbers its own way; fallback_random makes it use eager's RNG, so "sample" draws
    # the same uniforms in both runs. "top" uses no randomness and runs with the default configuration.
    patch = torch._inductor.config.patch(fallback_random=selection == "sample")
    with patch:
        torch.manual_seed(1)
        got = fwd_bwd(compiled, x, c)
    torch.manual_seed(1)
    want = fwd_bwd(layer, x, c)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    stats = layer.stats()
    assert float(stats.backward_calls) == 2.0  # the compiled backward fed the statistics probe too
    assert int(stats.retained_pairs) == int(0.75 * 4 * 16 * 2)


# A binding capacity and "random" scores share one compile (each compile of the layer costs CI seconds).
@pytest.mark.parametrize("backward_capacity, metric", [(None, "lrm"), (1.5, "random")])
def test_dynamic_token_counts_share_one_graph_and_match_eager(backward_capacity, metric, fwd_bwd):
    # torch.compile(dynamic=True): the token count is symbolic, so the row buffers (and C) are sized from it in
    # the graph; three token counts, one graph, eager's values ("random" scores: eager's RNG, fallback_random).
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    layer = LRMoE(32, 24, 8, 2, retain=0.75, selection="top", metric=metric, backward_capacity=backward_capacity)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for tokens in (64, 80, 120):
        x, c = torch.randn(tokens, 32), torch.randn(tokens, 32)
        torch.manual_seed(tokens)
        with torch._inductor.config.patch(fallback_random=True):
            got = fwd_bwd(compiled, x, c)
        torch.manual_seed(tokens)
        want = fwd_bwd(layer, x, c)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_dense_has_no_graph_break_and_matches(fwd_bwd):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(32, 24, 8, 2, retain=1.0)
    x, c = torch.randn(64, 32), torch.randn(64, 32)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0
    got = fwd_bwd(torch.compile(layer, fullgraph=True), x, c)
    want = fwd_bwd(layer, x, c)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_compiled_offload_copies_in_forward_and_reads_back_in_backward(fwd_bwd):
    # Only backward reads the host copy, so AOTAutograd's partitioner would move the copy into the backward graph
    # and save h on the device; the op's registered effect keeps it in forward. The partitioner Inductor uses
    # (min-cut), with the graphs captured instead of lowered.
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    graphs, modules = {}, {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = {str(t) for n in gm.graph.nodes for t in (n.target, *n.args)}
            modules[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(32, 24, 8, 2, retain=0.75, selection="top", activations="offload")
    x, c = torch.randn(64, 32), torch.randn(64, 32)
    got = fwd_bwd(torch.compile(layer, backend=backend, fullgraph=True), x, c)
    assert "lrmoe.offload_to_host.default" in graphs["forward"]
    assert "lrmoe.offload_to_host.default" not in graphs["backward"]
    assert "lrmoe.gather_host_rows.default" in graphs["backward"]
    # The forward ends with offload_wait(h, host, out): kept (effectful, no output), in the forward only, after the
    # copy. Its arguments, not only the effect token, order it after the copy and the layer's output.
    assert "lrmoe.offload_wait.default" not in graphs["backward"]
    nodes = list(modules["forward"].graph.nodes)
    copy, wait = (next(n for n in nodes if f"lrmoe.{op}.default" in map(str, n.args))
                  for op in ("offload_to_host", "offload_wait"))
    assert nodes.index(copy) < nodes.index(wait)
    h, host, out = wait.args[2:]
    assert h is copy.args[2] and host.args[0] is copy  # host: the copy's output, getitem(with_effects(...), 1)
    assert out.meta["val"].shape == x.shape
    for g, w in zip(got, fwd_bwd(layer, x, c)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_inductor_runs_the_offload_wait_after_the_copy(fwd_bwd):
    # What Inductor makes of it: the wait after the copy (Inductor 2.13 drops the effect token's ordering edge,
    # pytorch/pytorch#189209, and without the copy's output as an argument placed the wait first), on h itself, so
    # h's buffer is live until the wait; and the values of eager.
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(32, 24, 8, 2, retain=0.75, selection="top", activations="offload")
    x, c = torch.randn(64, 32), torch.randn(64, 32)
    compiled = torch.compile(layer, fullgraph=True)
    got, (code, *_) = run_and_get_code(lambda: fwd_bwd(compiled, x, c))
    copy = re.search(r"(\w+) = torch\.ops\.lrmoe\.offload_to_host\.default\((\w+)\)", code)
    wait = re.search(r"torch\.ops\.lrmoe\.offload_wait\.default\((\w+), (\w+), (\w+)\)", code)
    assert copy and wait and copy.start() < wait.start()
    assert wait.group(1) == copy.group(2)  # h
    for g, w in zip(got, fwd_bwd(layer, x, c)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("selection", ["top", "sample"])
def test_compiled_layer_graphs_hold_no_device_asserts_and_one_op_per_selection(selection, fwd_bwd):
    # Every node of the compiled step is a kernel launch on the GPU. The forward and backward graphs must hold no
    # device-side asserts (F.one_hot adds two reductions and two asserts), no scatter of the single-bin quota
    # sums, one sort in forward, and the selection as one custom op given the layer's dispatch order and offsets
    # (so it sorts nothing and, on CUDA, searches nothing itself).
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    torch.manual_seed(0)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    layer = LRMoE(32, 24, 8, 2, retain=0.75, selection=selection)
    x, c = torch.randn(64, 32), torch.randn(64, 32)
    fwd_bwd(torch.compile(layer, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture)),
            x, c)
    fwd, bwd = graphs
    # One sort in forward: the dispatch order (the quota plan of one source sorts nothing).
    assert sum("sort" in str(n.target) for n in fwd.graph.nodes) == 1
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "assert" in t], targets
    assert not [t for t in targets if "index_add" in t], targets
    (select,) = [n for n in bwd.graph.nodes if n.target is torch.ops.lrmoe.select_within_quota.default]
    assert len(select.args) == 9 and isinstance(select.args[6], torch.fx.Node)  # group_order given
    assert select.args[7] == 64  # max_group_size: T, each token picks an expert at most once
    assert isinstance(select.args[8], torch.fx.Node)  # group_ends given: the plan searches nothing either
    assert not [n for n in bwd.graph.nodes if "sort" in str(n.target)]
    torch._dynamo.reset()
