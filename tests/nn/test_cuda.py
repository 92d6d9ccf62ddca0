"""The same contracts on a GPU (run through the device tool; skipped on CPU-only machines)."""

from __future__ import annotations

import pytest
import torch
from cuda_sync import no_host_sync

from lrmoe.functional import compact_and_gemm
from lrmoe.nn import LRMoE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("retain, selection, backward_capacity", [(1.0, "top", None), (0.75, "top", None),
                                                                   (0.75, "top", 1.5)])
def test_cuda_fp32_equals_cpu(retain, selection, backward_capacity, fwd_bwd):
    torch.manual_seed(0)
    cpu = LRMoE(32, 24, 8, 2, retain=retain, selection=selection, backward_capacity=backward_capacity)
    gpu = LRMoE(32, 24, 8, 2, retain=retain, selection=selection, backward_capacity=backward_capacity).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, c = torch.randn(96, 32), torch.randn(96, 32)
    for a, b in zip(fwd_bwd(gpu, x.cuda(), c.cuda()), fwd_bwd(cpu, x, c)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


def test_cuda_source_grouped_plan_equals_cpu():
    """Pairs grouped by (source, expert) (the plan expert parallelism uses): each expert's GEMM offset is its last
    source group's end, a strided column of the selection's offsets. The CUDA GEMMs read offsets as a flat array,
    so they took every S-th group end: dx and the weight gradients were O(1) off (found on two GPUs)."""
    from cuda_paths import source_grouped_step

    names = ["out", "dx", "dgate_up", "ddown", "dgates"]
    for name, got, want in zip(names, source_grouped_step("cuda"), source_grouped_step("cpu"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("n_rows, empty", [(200, False), (200, True)])
def test_cuda_bf16_grouped_mm_matches_fp32_reference(n_rows, empty):
    torch.manual_seed(0)
    E, N, I, O = 8, 64, 32, 48
    sizes = torch.randint(0, 40, (E,))
    if empty:
        sizes[2] = 0
        sizes[-1] = 0
    offsets = torch.cumsum(sizes, 0).clamp(max=n_rows)
    rows = torch.randint(0, N, (n_rows,))
    rows[int(offsets[-1]):] = -1
    x = torch.randn(N, I)
    w = torch.randn(E, O, I) / I**0.5
    ref = compact_and_gemm(x, w, rows, offsets)
    xg = x.cuda().bfloat16().requires_grad_(True)
    wg = w.cuda().bfloat16().requires_grad_(True)
    got = compact_and_gemm(xg, wg, rows.cuda(), offsets.cuda())
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert (got[int(offsets[-1]):] == 0).all()
    g = torch.randn_like(ref)
    got.backward(g.cuda().bfloat16())
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    compact_and_gemm(xr, wr, rows, offsets).backward(g)
    torch.testing.assert_close(xg.grad.float().cpu(), xr.grad, rtol=3e-2, atol=5e-2)
    torch.testing.assert_close(wg.grad.float().cpu(), wr.grad, rtol=3e-2, atol=5e-2)


@pytest.mark.parametrize(
    "dtype, retain, tol",
    [
        # fp32 at retain 0.75: scores agree to round-off, so the same pairs are kept and the values match.
        (torch.float32, 0.75, 1e-4),
        # bf16: a different rounding order can flip which pairs sit at a quota's edge at retain < 1, so compare
        # bf16 at retain 1 (no selection), as a relative error of the whole tensor.
        (torch.bfloat16, 1.0, 2e-2),
    ],
)
def test_cuda_compile_fullgraph_matches_eager(dtype, retain, tol, fwd_bwd):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(128, 64, 16, 4, retain=retain, selection="top").cuda().to(dtype)
    x = torch.randn(512, 128, device="cuda", dtype=dtype)
    c = torch.randn_like(x)
    # Compiled first: a freshly moved module must trace without a graph break (nothing created in forward).
    got = fwd_bwd(torch.compile(layer, fullgraph=True), x, c)
    want = fwd_bwd(layer, x, c)
    for g, w in zip(got, want):
        err = (g.float() - w.float()).norm() / w.float().norm()
        assert err < tol, (tuple(w.shape), float(err))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("retain, selection, backward_capacity",
                         [(1.0, "sample", None), (0.75, "sample", None), (0.5, "top", None), (0.75, "top", 1.25)])
def test_no_host_sync_in_forward_backward(dtype, retain, selection, backward_capacity, compiled):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = LRMoE(128, 64, 16, 4, retain=retain, selection=selection,
                  backward_capacity=backward_capacity).cuda().to(dtype)
    fn = torch.compile(layer, fullgraph=True) if compiled else layer  # compiled: the kernels inlined in the graph
    x = torch.randn(512, 128, device="cuda", dtype=dtype, requires_grad=True)
    fn(x).sum().backward()  # first call: lazy initialisation and kernel compilation may synchronise
    with no_host_sync():
        fn(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("retain", [1.0, 0.75])
def test_offload_gives_the_gradients_of_save_keeps_h_pinned_and_never_syncs(dtype, retain):
    T, D, F, E, K = 512, 128, 48, 16, 4  # 2F != D: h [T*K, 2F] must not share a shape with the saved y [T*K, D]
    results, saved = {}, {}
    for activations in ("save", "offload"):
        torch.manual_seed(0)
        layer = LRMoE(D, F, E, K, retain=retain, selection="sample", activations=activations).cuda().to(dtype)
        x = torch.randn(T, D, device="cuda", dtype=dtype, requires_grad=True)
        c = torch.randn_like(x)
        layer(x).sum().backward()  # first call: lazy initialisation, kernel compilation, the side stream
        for t in (x, *layer.parameters()):
            t.grad = None
        saved[activations] = kept = []

        def pack(t, kept=kept):
            kept.append((t.device.type, t.is_pinned(), tuple(t.shape)))
            return t

        torch.manual_seed(1)
        with no_host_sync():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(x)
            (out * c).sum().backward()
        results[activations] = [out, x.grad, *(p.grad for p in layer.parameters())]
    for got, want in zip(results["offload"], results["save"]):
        assert torch.equal(got, want)  # the same h values: bit-identical
    h = (T * K, 2 * F)
    assert ("cuda", False, h) in saved["save"]
    assert ("cpu", True, h) in saved["offload"] and ("cuda", False, h) not in saved["offload"]


GLM = dict(score_func="sigmoid", routed_scaling_factor=2.5, n_group=4, topk_group=2, selection_bias=True,
           shared_hidden_dim=32)


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_glm_block_equals_cpu_and_never_syncs(compiled, fwd_bwd):
    """The GLM-4.5 / DeepSeek-V3 options on the GPU: fp32 equals the CPU layer, and a bf16 step has no host
    synchronisation (the bias and the group mask on the device, the shared expert beside the routed ones)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cpu = LRMoE(32, 24, 8, 2, retain=0.75, selection="top", **GLM)
    with torch.no_grad():
        cpu.gate.e_score_correction_bias.normal_(0, 0.3)
    gpu = LRMoE(32, 24, 8, 2, retain=0.75, selection="top", **GLM).cuda()
    gpu.load_state_dict(cpu.state_dict())
    fn = torch.compile(gpu, fullgraph=True) if compiled else gpu
    x, c = torch.randn(96, 32), torch.randn(96, 32)
    for a, b in zip(fwd_bwd(fn, x.cuda(), c.cuda()), fwd_bwd(cpu, x, c)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)

    torch._dynamo.reset()
    layer = LRMoE(128, 64, 16, 4, retain=0.75, selection="sample", **GLM).cuda().bfloat16()
    assert layer.gate.e_score_correction_bias.dtype == torch.float32
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn(x).sum().backward()  # first call: lazy initialisation and kernel compilation may synchronise
    with no_host_sync():
        fn(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_swiglu_experts_module_never_syncs_and_evaluation_draws_nothing(compiled):
    """SwiGLUExperts called as transformers calls its experts (what swap_experts installs), bf16, retain 0.5
    "sample": the module's own plan (no plan passed) in training never synchronises, and equals the CPU forward;
    in eval() without grad the CUDA RNG stays where it was."""
    from lrmoe.nn import SwiGLUExperts

    torch.manual_seed(0)
    E, D, F, T, K = 8, 64, 48, 96, 2
    experts = SwiGLUExperts(E, D, F, retain=0.5, selection="sample").cuda().bfloat16()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    gates = torch.rand(T, K, device="cuda").softmax(-1)
    run = torch.compile(experts, fullgraph=True) if compiled else experts

    def step():
        xg = x.clone().requires_grad_(True)
        out = run(xg, ids, gates)
        out.float().square().sum().backward()
        return out

    step()  # compilation and autotuning may synchronise
    experts.zero_grad()
    with no_host_sync():
        out = step()
    want = SwiGLUExperts(E, D, F)
    want.load_state_dict({k: v.float().cpu() for k, v in experts.state_dict().items()})
    with torch.no_grad():
        ref = want(x.float().cpu(), ids.cpu(), gates.cpu())
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    assert experts.down_proj.grad is not None and experts.down_proj.grad.abs().sum() > 0

    experts.eval()
    with torch.no_grad():
        state = torch.cuda.get_rng_state()
        run(x, ids, gates)
        assert torch.equal(torch.cuda.get_rng_state(), state)
