"""Scoring kernel variants at T=8192, graph timing over rotating buffers (same as benchmarks/scoring_bandwidth.py).

    PYTHONPATH=. python3 benchmarks/scoring_variants.py      (GPU)

Tried in the twelfth session and not kept (no variant beat the kernel's 4 x 128 blocks at D = 2048): software-
pipelined and unrolled loops over D (tl.range num_stages / loop_unroll_factor) and a persistent grid over row
blocks. Numbers in docs/performance.md, "Twelfth GPU session"; the script is removed again in the next commit."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "benchmarks")
from scoring_bandwidth import graph_ms, rotating_copies, copy_bandwidth
from triton.testing import do_bench
from lrmoe_kernels.scoring import score_pairs_triton, _is_finite

@triton.jit
def _pairs(gates_ptr, phi_ptr, out_ptr, g_sq_T, t_T, t_ok_T, K, BLOCK_K: tl.constexpr):
    k_K = tl.arange(0, BLOCK_K)
    t64 = t_T.to(tl.int64)
    m = t_ok_T[:, None] & (k_K < K)[None, :]
    a = tl.load(gates_ptr + t64[:, None] * K + k_K[None, :], mask=m, other=0.0).to(tl.float32)
    p = tl.load(phi_ptr + t64[:, None] * K + k_K[None, :], mask=m, other=0.0).to(tl.float32)
    s = a * a * g_sq_T[:, None] * p
    ok = _is_finite(s) & _is_finite(a) & _is_finite(p) & _is_finite(g_sq_T)[:, None]
    tl.store(out_ptr + t64[:, None] * K + k_K[None, :], tl.where(ok, s, float("inf")), mask=m)

@triton.jit
def k_staged(gates_ptr, g_ptr, phi_ptr, out_ptr, T, K, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    t_T = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t_T < T
    row = g_ptr + t_T.to(tl.int64) * D
    d_D = tl.arange(0, BLOCK_D)
    sq = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES, loop_unroll_factor=UNROLL):
        g = tl.load(row[:, None] + (d0 + d_D)[None, :], mask=t_ok[:, None] & ((d0 + d_D) < D)[None, :], other=0.0)
        g = g.to(tl.float32)
        sq += g * g
    _pairs(gates_ptr, phi_ptr, out_ptr, tl.sum(sq, 1), t_T, t_ok, K, BLOCK_K)

@triton.jit
def k_persist(gates_ptr, g_ptr, phi_ptr, out_ptr, T, K, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # one [BLOCK_T, BLOCK_D >= D] load per tile; the tile loop is pipelined
    pid = tl.program_id(0)
    n = tl.cdiv(T, BLOCK_T)
    d_D = tl.arange(0, BLOCK_D)
    for tile in tl.range(pid, n, tl.num_programs(0), num_stages=STAGES):
        t_T = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t_T < T
        g = tl.load(g_ptr + t_T.to(tl.int64)[:, None] * D + d_D[None, :], mask=t_ok[:, None] & (d_D < D)[None, :],
                    other=0.0).to(tl.float32)
        _pairs(gates_ptr, phi_ptr, out_ptr, tl.sum(g * g, 1), t_T, t_ok, K, BLOCK_K)

T, K = 8192, 8
sms = torch.cuda.get_device_properties(0).multi_processor_count
copy_bps = copy_bandwidth(do_bench); print(f'copy 1 GiB {copy_bps/1e12:.2f} TB/s')
for D in (2048, 4096):
    torch.manual_seed(0)
    gates = torch.rand(T, K, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    phi = torch.rand(T, K, device="cuda", dtype=torch.float32)
    nbytes = sum(t.numel() * t.element_size() for t in (gates, grad, phi)) + T * K * 4
    sets = rotating_copies((gates, grad, phi))
    want = score_pairs_triton(gates, grad, phi, "lrm")
    src = [(torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda"),) for _ in sets]
    base = graph_ms(torch.clone, src)
    print(f"D={D} copy same bytes {base*1e3:.1f} us; read-only torch sum {graph_ms(lambda a, g, p: g.sum(1), sets)*1e3:.1f} us")
    def row(name, fn):
        got = fn(gates, grad, phi)
        ok = torch.allclose(got, want, rtol=1e-4, atol=0)
        ms = graph_ms(fn, sets)
        print(f"D={D} {name:34} {ms*1e3:6.1f} us  {nbytes/ms/1e9:5.2f} TB/s  {nbytes/ms/copy_bps*1e3:5.0%} of copy  ok={ok}")
    row("current", lambda a, g, p: score_pairs_triton(a, g, p, "lrm"))
    for bt, bd, nw, st, un in [(4, 128, 4, 1, 1), (4, 128, 4, 3, 1), (4, 128, 4, 1, 2), (4, 128, 4, 1, 4),
                               (8, 128, 4, 3, 1), (4, 256, 4, 1, 2), (2, 256, 4, 1, 4), (4, 512, 4, 1, 1), (4, 512, 4, 3, 1), (4, 512, 4, 4, 1), (4, 512, 4, 1, 4),
                               (8, 512, 4, 3, 1), (2, 512, 4, 3, 1), (4, 256, 4, 3, 1), (2, 1024, 4, 3, 1),
                               (4, 512, 8, 3, 1), (1, 512, 4, 4, 1), (4, 512, 4, 2, 1)]:
        def fn(a, g, p, bt=bt, bd=bd, nw=nw, st=st, un=un):
            out = torch.empty(T, K, device="cuda", dtype=torch.float32)
            k_staged[(triton.cdiv(T, bt),)](a, g, p, out, T, K, D, BLOCK_T=bt, BLOCK_D=bd, BLOCK_K=8, STAGES=st,
                                            UNROLL=un, num_warps=nw)
            return out
        row(f"staged t{bt} d{bd} w{nw} st{st} un{un}", fn)
    for bt, nw, st, per_sm in [(1, 4, 3, 8), (2, 4, 3, 8), (1, 4, 4, 16), (2, 8, 3, 4), (4, 8, 3, 4), (1, 4, 2, 16)]:
        def fn(a, g, p, bt=bt, nw=nw, st=st, per_sm=per_sm):
            out = torch.empty(T, K, device="cuda", dtype=torch.float32)
            k_persist[(min(triton.cdiv(T, bt), sms * per_sm),)](a, g, p, out, T, K, D, BLOCK_T=bt,
                BLOCK_D=triton.next_power_of_2(D), BLOCK_K=8, STAGES=st, num_warps=nw)
            return out
        row(f"persistent t{bt} w{nw} st{st} {per_sm}/SM", fn)
