"""Under torch.compile, CUDA calls of the kernel ops are traced into their Triton kernels (lrmoe.ops._kernels.
inline_when_compiled) and give what the eager op gives; CPU calls stay one opaque op each (the reference)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import lrmoe.ops as ops

CUDA = torch.cuda.is_available()


def _cases(device: str, dtype: torch.dtype):
    """(name, fn, args, what the CUDA graph must launch instead of the op) per inlined op."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    T, K, N, C, E = 48, 4, 96, 64, 8
    rows_TK = torch.randint(-1, N, (T, K), generator=g).to(device)
    gates_TK = torch.rand(T, K, generator=g).to(device)
    P = T * K
    groups_P = torch.randint(0, E, (P,), generator=g).to(device)
    order_P = torch.argsort(groups_P, stable=True)
    ends_E = torch.bincount(groups_P, minlength=E).cumsum(0)
    quotas_E = torch.randint(0, 40, (E,), generator=g).to(device)
    uniform_E = torch.rand(E, generator=g).to(device)
    loads_E = torch.randint(0, 60, (E,), generator=g).to(device)
    scores_P = torch.rand(P, generator=g).to(device)
    sizes_E = torch.randint(0, 24, (E,), generator=g)
    offsets_E = torch.cumsum(sizes_E, 0).clamp(max=N).int().to(device)
    rows_N = torch.randint(0, N, (N,), generator=g).to(device)
    return [
        ("gather_sum_rows", ops.gather_sum_rows, (randn(N, C), rows_TK, gates_TK.to(dtype)), "_gather_sum_rows_kernel"),
        ("gather_dot_rows", ops.gather_dot_rows, (randn(N, C), rows_TK, randn(T, C)), "_gather_dot_rows_kernel"),
        ("gather_dot_scores", ops.gather_dot_scores,
         (randn(N, C), rows_TK, randn(T, C), gates_TK.to(dtype), torch.rand(T, K, generator=g).to(device), "lrm"),
         "_gather_dot_scores_kernel"),
        ("score_pairs", ops.score_pairs, (gates_TK, randn(T, C), torch.rand(T, K, generator=g).to(device), "lrm"),
         "_score_pairs_kernel"),
        ("select top", ops.select_within_quota, (scores_P, groups_P, quotas_E, 160, "top", None, order_P, T),
         "_top_kernel"),
        ("select sample", ops.select_within_quota,
         (scores_P, groups_P, quotas_E, 160, "sample", uniform_E, order_P, T), "_compact_kernel"),
        ("select top, group ends", ops.select_within_quota,
         (scores_P, groups_P, quotas_E, 160, "top", None, order_P, T, ends_E), "_plan_kernel"),
        ("gather_grouped_mm", ops.gather_grouped_mm, (randn(N, C), randn(E, 32, C), rows_N, offsets_E),
         "_zero_tail_kernel"),
        ("grouped_outer", ops.grouped_outer, (randn(N, 32), randn(N, C), rows_N, offsets_E), "_grouped_mm"),
        ("swiglu_backward", ops.swiglu_backward, (randn(N, C), rows_N[:40], randn(40, C // 2)),
         "_swiglu_backward_kernel"),
        ("swiglu_backward_scaled", ops.swiglu_backward_scaled,
         (randn(N, C), rows_N[:40], randn(40, C // 2), torch.rand(40, generator=g).to(device)),
         "_swiglu_backward_scaled_kernel"),
        ("swiglu_dot", ops.swiglu_dot, (randn(N, C), rows_N[:40], randn(40, C // 2)), "_swiglu_dot_kernel"),
        ("gather_scale_rows", ops.gather_scale_rows, (randn(N, C), rows_N[:40], torch.rand(40, generator=g).to(device)),
         "_gather_rows_kernel"),
        ("swiglu_sqnorm", ops.swiglu_sqnorm, (randn(N, C),), "_swiglu_sqnorm_kernel"),
        ("topk_ids", ops.topk_ids, (randn(T, 2 * E), K), "_topk_ids_kernel"),
        ("waterfill", ops.waterfill, (loads_E, loads_E // 4, loads_E.sum() * 2 // 3), "_waterfill_kernel"),
    ]


def _compiled(fn, args):
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code)


N_CASES = 16


@pytest.mark.parametrize("case", range(N_CASES))
def test_cpu_graphs_keep_each_op_whole(case):
    name, fn, args, _ = _cases("cpu", torch.float32)[case]
    out, code = _compiled(fn, args)
    assert f"torch.ops.{fn._qualname.replace('::', '.')}.default" in code, name
    for got, want in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(fn(*args))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("case", range(N_CASES))
def test_cuda_graphs_launch_the_kernels_and_match_eager(case):
    name, fn, args, kernel = _cases("cuda", torch.bfloat16)[case]
    out, code = _compiled(fn, args)
    assert "torch.ops.lrmoe" not in code, name  # no opaque op call left
    assert kernel in code, name
    for got, want in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(fn(*args))):
        assert torch.equal(got, want), name  # the same kernels on the same inputs: bit for bit


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_backward_formulas_are_inlined_too():
    g = torch.Generator().manual_seed(1)
    src = torch.randn(96, 64, generator=g).cuda().bfloat16().requires_grad_(True)
    w = torch.rand(48, 4, generator=g).cuda().requires_grad_(True)
    rows = torch.randint(-1, 96, (48, 4), generator=g).cuda()

    def f(src, w):
        return ops.gather_sum_rows(src, rows, w).float().square().sum()

    torch._dynamo.reset()
    loss, code = run_and_get_code(lambda: torch.autograd.grad(torch.compile(f, fullgraph=True)(src, w), (src, w)))
    want = torch.autograd.grad(f(src, w), (src, w))
    assert "torch.ops.lrmoe" not in "\n".join(code)
    assert "_gather_dot_rows_kernel" in "\n".join(code)  # the weights' gradient, from the backward formula
    for a, b in zip(loss, want):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


# What each inlined kernel stores to, read off the kernels' code: the launchers' output and scratch buffers.
KERNEL_WRITES = {
    "_gather_sum_rows_kernel": ["out_ptr"],
    "_gather_dot_rows_kernel": ["out_ptr"],
    "_gather_dot_scores_kernel": ["out_ptr", "score_ptr"],
    "_score_pairs_kernel": ["out_ptr"],
    "_plan_kernel": ["starts_ptr", "sizes_ptr", "takes_ptr", "bases_ptr", "counts_ptr", "offsets_ptr"],
    "_top_kernel": ["pair_ids_ptr", "weights_ptr"],
    "_group_keys_kernel": ["keys_ptr", "pair_ids_ptr", "weights_ptr"],
    "_group_sort_kernel": ["by_score_ptr", "pair_ids_ptr", "weights_ptr"],
    "_sample_probabilities_kernel": ["tail_a_ptr", "tail_b_ptr", "p_ptr"],
    "_compact_kernel": ["pair_ids_ptr", "weights_ptr"],
    "_zero_tail_kernel": ["y_ptr"],
    "_swiglu_backward_kernel": ["dh_ptr", "phi_ptr"],
    "_swiglu_backward_scaled_kernel": ["dh_ptr", "cphi_ptr", "dot_ptr"],
    "_swiglu_dot_kernel": ["dot_ptr"],
    "_gather_rows_kernel": ["out_ptr"],
    "_swiglu_sqnorm_kernel": ["phi_ptr", "sq_ptr"],
    "_topk_ids_kernel": ["ids_ptr"],
    "_waterfill_kernel": ["quotas_ptr"],
}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_compile_sees_each_kernel_write_exactly_its_outputs():
    # torch.compile's view of what each inlined kernel writes (tests/ops/kernel_writes.py says how and why): a
    # kernel's input counted as written is copied and written back by the compiled graph, which went wrong on the
    # H200 for an input that was a view (the expert-parallel quotas with the plan on the host).
    script = os.path.join(os.path.dirname(__file__), "kernel_writes.py")
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout)
    assert set(found["inlined"]) == {case[1]._qualname for case in _cases("cpu", torch.float32)}  # all covered
    launched = set()
    for launch in found["cases"]:
        assert launch["writes"] == KERNEL_WRITES[launch["kernel"]], launch
        launched.add(launch["kernel"])
    assert launched == set(KERNEL_WRITES)
