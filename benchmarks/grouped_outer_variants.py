"""Weight-gradient grouped GEMM variants: persistent grid and/or TMA-descriptor output store, against the current
grouped_outer_triton and torch._grouped_mm (pre-gathered).

    PYTHONPATH=. python3 benchmarks/grouped_outer_variants.py [--quick]   (--quick: a tiny correctness check that
                                                                           also runs in Triton's interpreter)

Tried in the twelfth session and not kept (1-3 % faster on balanced groups, 3-16 % slower on skewed ones). Numbers
in docs/performance.md, "Twelfth GPU session"; the script is removed again in the next commit."""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from grouped_gemm import SHAPES, make_inputs, rel_err  # noqa: E402

from lrmoe_kernels.grouped_gemm import grouped_outer_triton  # noqa: E402

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


@triton.jit
def _outer_persist(
    a_ptr, b_ptr, rows_ptr, offsets_ptr, w_ptr, w_desc,
    R, O, I, E,
    stride_ar, stride_ao, stride_bn, stride_bi, stride_we, stride_wo, stride_wi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_PROGS: tl.constexpr,
    TMA_STORE: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(O, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    per_e = num_m * num_n
    total = E * per_e
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(pid, total, NUM_PROGS, flatten=FLATTEN):
        e = tile // per_e
        pid_m = (tile % per_e) // num_n
        pid_n = tile % num_n
        start = tl.minimum(tl.load(offsets_ptr + e - 1, mask=e > 0, other=0).to(tl.int32), R)
        end = tl.minimum(tl.load(offsets_ptr + e).to(tl.int32), R)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m_safe = offs_m % O
        offs_n_safe = offs_n % I
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_K):
            offs_r = r0 + offs_k
            r_mask = offs_r < end
            src_r = tl.load(rows_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
            a = tl.load(a_ptr + offs_m_safe[:, None] * stride_ao + offs_r[None, :].to(tl.int64) * stride_ar,
                        mask=r_mask[None, :], other=0.0)
            b = tl.load(b_ptr + src_r[:, None] * stride_bn + offs_n_safe[None, :] * stride_bi,
                        mask=r_mask[:, None], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if TMA_STORE:
            w_desc.store([e, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(w_ptr.dtype.element_ty)[None, :, :])
        else:
            w_ptrs = (w_ptr + e.to(tl.int64) * stride_we
                      + offs_m[:, None].to(tl.int64) * stride_wo + offs_n[None, :] * stride_wi)
            tl.store(w_ptrs, acc.to(w_ptr.dtype.element_ty), mask=(offs_m[:, None] < O) & (offs_n[None, :] < I))


def outer_persist(a_RO, b_NI, rows_R, offsets_E, bm, bn, bk, nw, ns, progs, tma, flatten):
    R, O, I, E = rows_R.shape[0], a_RO.shape[1], b_NI.shape[1], offsets_E.shape[0]
    w = torch.empty((E, O, I), dtype=a_RO.dtype, device=a_RO.device)
    desc = TensorDescriptor.from_tensor(w, [1, bm, bn]) if tma else w
    total = E * triton.cdiv(O, bm) * triton.cdiv(I, bn)
    p = min(progs, total)
    _outer_persist[(p,)](a_RO, b_NI, rows_R, offsets_E, w, desc, R, O, I, E, *a_RO.stride(), *b_NI.stride(),
                         *w.stride(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGS=p, TMA_STORE=tma,
                         FLATTEN=flatten, UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=nw,
                         num_stages=ns)
    return w


def quick():
    torch.manual_seed(0)
    E, N, O, I = 3, 40, 32, 48
    sizes = torch.tensor([17, 0, 50])
    rows = torch.randint(0, N, (int(sizes.sum()),))
    offs = sizes.cumsum(0).int()
    a = torch.randn(rows.shape[0], O)
    b = torch.randn(N, I)
    want = torch.stack([a[s:e].T @ b[rows[s:e]] for s, e in zip([0] + offs[:-1].tolist(), offs.tolist())])
    for tma in (False, True):
        for flatten in (False, True):
            got = outer_persist(a, b, rows, offs, 16, 16, 16, 4, 2, 2, tma, flatten)
            print(f"tma={tma} flatten={flatten} max err {(got - want).abs().max().item():.2e}")


def main():
    from triton.testing import do_bench
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {"cur": None}
    for bm, bn, bk, nw, ns in [(256, 128, 32, 8, 5), (256, 128, 32, 8, 4), (128, 128, 32, 4, 6),
                               (128, 256, 32, 8, 5), (128, 128, 64, 4, 4)]:
        for per_sm in (1, 2):
            if per_sm == 2 and bm * bn > 128 * 128:
                continue
            for tma, flatten in [(False, False), (True, False), (True, True), (False, True)]:
                variants[f"p{bm}x{bn}x{bk} w{nw} s{ns} {per_sm}/SM tma{int(tma)} fl{int(flatten)}"] = (
                    bm, bn, bk, nw, ns, sms * per_sm, tma, flatten)
    # non-persistent equivalent: one program per tile, TMA store
    for bm, bn, bk, nw, ns in [(256, 128, 32, 8, 5)]:
        variants[f"np{bm}x{bn}x{bk} w{nw} s{ns} tma1"] = (bm, bn, bk, nw, ns, 10**9, True, False)
    print(f"# wgrad variants, R=65536, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; ms median of 3 do_bench rounds; ratio = _grouped_mm / variant")
    for name in ["qwen3-up", "qwen3-down", "glm-up", "glm-down"]:
        I, O = SHAPES[name]
        for skewed in (False, True):
            (x_NI, _, a_RO, rows_R, offsets_E), _ = make_inputs(65536, I, O, skewed)
            x_RI = x_NI.index_select(0, rows_R)
            ref = lambda: torch._grouped_mm(a_RO.t(), x_RI, offs=offsets_E)  # noqa: E731
            want = ref()
            fns = {"_grouped_mm": ref, "cur": lambda: grouped_outer_triton(a_RO, x_NI, rows_R, offsets_E)}
            for k, v in variants.items():
                if v is None:
                    continue
                fns[k] = lambda v=v: outer_persist(a_RO, x_NI, rows_R, offsets_E, *v)
            ok = {}
            for k, fn in list(fns.items()):
                try:
                    ok[k] = rel_err(fn(), want)
                except Exception as exc:  # a variant that does not compile
                    print(f"{name} {k}: {type(exc).__name__}: {str(exc)[:150]}")
                    del fns[k]
            times = {k: [] for k in fns}
            for _ in range(3):
                for k, fn in fns.items():
                    times[k].append(do_bench(fn, warmup=10, rep=40, return_mode="median"))
            ms = {k: statistics.median(t) for k, t in times.items()}
            best = sorted(ms, key=ms.get)[:6]
            for k in ["_grouped_mm", "cur"] + [b for b in best if b not in ("_grouped_mm", "cur")]:
                print(f"{name:>10} {'skew' if skewed else 'bal':>4} {k:>42} {ms[k]:7.3f} "
                      f"{ms['_grouped_mm'] / ms[k]:5.2f} err {ok[k]:.1e}")


if __name__ == "__main__":
    quick() if "--quick" in sys.argv else main()
