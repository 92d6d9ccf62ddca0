"""The GPU's matrix rate in a short burst and under sustained load (GPU, bf16).

    PYTHONPATH=. python3 benchmarks/sustained_rate.py [--seconds 6] [--window 0.5]

DESIGN.md §7's 694 TFLOP/s (a dense 8192³ bf16 matmul) is the rate the issue's GEMM floor assumes. A training step
keeps the GPU busy for seconds, and an H200 at full matrix load can reach its power limit and lower its clocks, so a
rate timed over a few milliseconds after idle may not be the rate a sustained loop gets. For each problem this script
idles the GPU for --idle seconds, then runs the GEMM back to back for --seconds, timing batches of calls with CUDA
events, and prints the TFLOP/s of the fastest batch in the first 0.2 s (burst: the clocks ramp up from idle first), the
median batch of each --window of GPU time, and the last window over the burst.
Problems: the dense 8192³ matmul, and torch._grouped_mm at the Qwen3-30B-A3B gate/up shape (65,536 rows, 128
experts, 2048 → 1536) on equal groups and on a random router's groups (512 ± ~22 rows). To see the clocks and the
power, run ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 100``
beside it. Importable on a CPU machine; main() needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def problems(device: str = "cuda") -> dict:
    gen = torch.Generator().manual_seed(0)
    n = 8192
    a, b = (torch.randn(n, n, generator=gen).bfloat16().to(device) for _ in range(2))
    rows, experts, dim, out = 65536, 128, 2048, 1536
    x = torch.randn(rows, dim, generator=gen).bfloat16().to(device)
    w = (torch.randn(experts, out, dim, generator=gen) / dim**0.5).bfloat16().to(device).transpose(-2, -1)
    equal = torch.full((experts,), rows // experts).cumsum(0).int().to(device)
    ids = torch.randn(rows // 8, experts, generator=gen).topk(8, dim=1).indices.reshape(-1)
    router = torch.bincount(ids, minlength=experts).cumsum(0).int().to(device)
    gemm_flop = 2 * rows * dim * out
    return {
        "matmul 8192^3": (lambda: a @ b, 2 * n**3),
        "_grouped_mm gate/up, equal groups": (lambda: torch._grouped_mm(x, w, offs=equal), gemm_flop),
        "_grouped_mm gate/up, router groups": (lambda: torch._grouped_mm(x, w, offs=router), gemm_flop),
    }


def sustained(fn, seconds: float, batch: int) -> list[tuple[float, float]]:
    """(GPU ms, ms per call) of consecutive batches of ``batch`` calls, back to back for about ``seconds``."""
    events = []
    wall_end = time.perf_counter() + seconds
    while time.perf_counter() < wall_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        events.append((start, end))
        if len(events) % 8 == 0:
            events[-8][1].synchronize()  # keep the host at most 16 batches ahead, so the wall time bounds the GPU's
    torch.cuda.synchronize()
    out, clock = [], 0.0
    for start, end in events:
        ms = start.elapsed_time(end)
        clock += ms
        out.append((clock, ms / batch))
    return out


def window_medians(batches: list[tuple[float, float]], window_ms: float) -> list[float]:
    """The median ms per call of the batches in each window [i * window_ms, (i + 1) * window_ms) of GPU time, in
    window order: a batch belongs to the window its end falls in; windows without a batch are skipped, and the
    window of the last batch is dropped (the run ended inside it)."""
    windows: dict[int, list[float]] = {}
    for clock, ms in batches:
        windows.setdefault(int(clock // window_ms), []).append(ms)
    if batches:
        del windows[int(batches[-1][0] // window_ms)]
    return [statistics.median(windows[i]) for i in sorted(windows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--window", type=float, default=0.5, help="seconds of GPU time per printed window")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idle before each problem")
    ap.add_argument("--batch", type=int, default=10, help="calls per timed batch")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sustained_rate.py needs CUDA")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; TFLOP/s per window of GPU time")
    for name, (fn, flop) in problems().items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        time.sleep(args.idle)
        batches = sustained(fn, args.seconds, args.batch)
        rate = [flop / ms / 1e9 for ms in window_medians(batches, args.window * 1e3)]
        if not rate:
            raise SystemExit(f"--seconds {args.seconds} gave no whole --window {args.window} of GPU time")
        # clocks ramp up from idle: the fastest batch ending in the first 0.2 s (or the first batch)
        burst = max(flop / ms / 1e9 for clock, ms in batches if clock <= 200 or clock == batches[0][0])
        print(f"{name}: burst (the fastest batch of {args.batch} calls in the first 0.2 s) {burst:.0f}; windows "
              + " ".join(f"{r:.0f}" for r in rate) + f"; last / burst {rate[-1] / burst:.3f}")


if __name__ == "__main__":
    main()
