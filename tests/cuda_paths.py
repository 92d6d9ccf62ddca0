"""The layers' CUDA code paths on CPU: every lrmoe op's CUDA kernel registered for CPU tensors too, its Triton
kernels run by Triton's interpreter. Run as a script in a process of its own (the registration is global and
cannot be undone), by tests/test_cuda_paths_on_cpu.py:

    TRITON_INTERPRET=1 python tests/cuda_paths.py single   # the single-device layer and a source-grouped plan
    TRITON_INTERPRET=1 python tests/cuda_paths.py ep       # the expert-parallel layer on 2 gloo ranks

Each case runs first with the ops' CPU references, then with the CUDA kernels, on the same inputs, and the two
must agree. The kernel tests check each launcher alone; this checks what the layers pass them (a strided offsets
column read as a flat array gave gradients O(1) off on the GPU while every CPU test passed). A line "ok <case>"
per case; an AssertionError names the case and the output that differs.
"""

from __future__ import annotations

import os
import sys

import torch

# Ops whose CUDA kernels need a real device (host-memory streams): they keep their CPU kernels.
_KEEP_CPU = ("lrmoe::offload_to_host", "lrmoe::offload_wait")


def use_cuda_kernels_on_cpu() -> list[str]:
    """Register every lrmoe op's CUDA kernel as its CPU kernel (this process only). Returns the ops' names."""
    from torch._library.custom_ops import CustomOpDef

    import lrmoe.nn  # noqa: F401  (imports every module that defines an op)
    from lrmoe.ops._kernels import kernel_module

    launch = kernel_module("launch")
    if launch is None or not launch.interpreting():
        raise RuntimeError("needs Triton, with TRITON_INTERPRET=1 set before this process starts")
    ops = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("lrmoe"):
            ops.update({v._qualname: v for v in vars(module).values() if isinstance(v, CustomOpDef)})
    moved = []
    for name, op in sorted(ops.items()):
        if "cuda" in op._backend_fns and name not in _KEEP_CPU:
            op.register_kernel("cpu")(op._backend_fns["cuda"])
            moved.append(name)
    return moved


def _compare(case: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"{case}, output {i}: {m}")
    sys.stdout.write(f"ok {case}\n")  # one write of a whole line: two ranks share the pipe
    sys.stdout.flush()


def _layer_step(layer, x, c):
    from layer_step import forward_backward

    torch.manual_seed(1)  # the same uniforms for "sample" in both runs
    return forward_backward(layer, x, c)


def source_grouped_step(device: str = "cpu") -> list[torch.Tensor]:
    """[out, dx, dgate_up, ddown, dgates] on CPU of one selective_swiglu_experts step on ``device`` with pairs
    grouped by (source, expert), retain 0.5 "top": each expert's GEMM offset is a strided column of the selection's
    group ends (also tests/nn/test_cuda.py, CUDA against CPU)."""
    from lrmoe.functional import plan_experts, selective_swiglu_experts

    torch.manual_seed(0)
    T, D, F, E, K, S = 30, 16, 8, 4, 2, 3
    x, g = torch.randn(T, D), torch.randn(T, D)
    leaves = [t.to(device).requires_grad_(True) for t in (x, torch.randn(E, 2 * F, D) / 4,
                                                          torch.randn(E, D, F) / 3, torch.rand(T, K))]
    ids, src = torch.randn(T, E).topk(K, dim=1).indices.to(device), (torch.arange(T) % S).to(device)
    plan = plan_experts(ids, E, retain=0.5, selection="top", draw_uniform=False, source_ids_T=src, num_sources=S)
    out = selective_swiglu_experts(*leaves[:3], ids, leaves[3], retain=0.5, selection="top", plan=plan)
    (out * g.to(device)).sum().backward()
    return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]


_LAYERS = {
    "retain 1": {"retain": 1.0, "selection": "top"},
    "retain 0.75 top": {"retain": 0.75, "selection": "top"},
    "retain 0.5 sample": {"retain": 0.5, "selection": "sample"},
    "retain 0.75 backward_capacity 1.5": {"retain": 0.75, "selection": "top", "backward_capacity": 1.5},
    "retain 0.75 recompute": {"retain": 0.75, "selection": "top", "activations": "recompute"},
    "DeepSeek-V3 routing, shared expert": {"retain": 0.5, "selection": "sample", "score_func": "sigmoid",
                                           "selection_bias": True, "n_group": 2, "topk_group": 1,
                                           "routed_scaling_factor": 2.5, "shared_hidden_dim": 8},
}


def single_device() -> None:
    from lrmoe.nn import LRMoE

    def run_all():
        results = {}
        for case, kwargs in _LAYERS.items():
            torch.manual_seed(0)
            layer = LRMoE(16, 8, 4, 2, **kwargs)
            x, c = torch.randn(24, 16), torch.randn(24, 16)
            results[case] = _layer_step(layer, x, c)
        results["source-grouped plan, retain 0.5"] = source_grouped_step()
        return results

    want = run_all()
    use_cuda_kernels_on_cpu()
    for case, got in run_all().items():
        _compare(case, got, want[case])


_EP = {  # (tokens per rank, E, k, retain, ExpertParallel options)
    "uneven, retain 0.5": ([10, 13], 8, 2, 0.5, {}),
    "a rank keeping no pairs": ([1, 40], 4, 1, 0.5, {}),  # rank 0's one pair rounds to a quota of 0
    "a rank without tokens": ([0, 12], 8, 2, 0.75, {"capacity_factor": 1.0}),
    "replicas and capacity": ([12, 9], 8, 2, 0.75, {"max_replicas": 1, "capacity_factor": 1.0}),
    "blocked backward": ([12, 9], 8, 2, 0.5, {"capacity_factor": 1.0, "backward_blocks": True}),
}


def _ep_rank(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lrmoe.nn import ExpertParallel, LRMoE

    mesh = init_device_mesh("cpu", (world,))

    def run_all():
        results = {}
        for case, (counts, n_exp, top_k, retain, style) in _EP.items():
            torch.manual_seed(0)
            layer = parallelize_module(LRMoE(8, 6, n_exp, top_k, retain=retain, selection="top"), mesh,
                                       ExpertParallel(**style))
            x, c = torch.randn(sum(counts), 8), torch.randn(sum(counts), 8)
            rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
            results[case] = _layer_step(layer, x[rows], c[rows])
            if case == "a rank keeping no pairs":
                assert int(layer.stats().quotas[0].sum()) == 0 < int(layer.stats().loads[0].sum()), "not the case meant"
        return results

    want = run_all()
    use_cuda_kernels_on_cpu()
    for case, got in run_all().items():
        _compare(f"rank {rank}: {case}", got, want[case])


def expert_parallel() -> None:
    from ep_harness import run_ranks

    run_ranks(2, _ep_rank)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.join(here, "nn")]  # layer_step, ep_harness (and this module, for the ranks)
    {"single": single_device, "ep": expert_parallel}[sys.argv[1]]()
