"""Is the eager LRMoE layer host-bound? Host time per forward+backward step against the step's wall time (GPU).

    PYTHONPATH=. python3 benchmarks/eager_host.py [--shape qwen3-30b-a3b] [--tokens 256 8192] [--retain 1 0.75 0.5]

For each (tokens, retain): the eager layer (bf16, top selection) runs 10 steps with no synchronisation inside the
loop: "host" is the time until the last step's launches are issued, "wall" the time until the GPU has finished
them too (both per step). When host ≈ wall the step waits on the host (Python, dispatch, launches); at a small
token count the GPU work is negligible and host is the layer's pure launch cost. "GPU activities" counts the
kernels and copies of one step (torch.profiler), i.e. the launches the host pays for.
"""

from __future__ import annotations

import argparse
import time

import torch
from layer_fwd_bwd import SHAPES

from lrmoe.nn import LRMoE


def make_step(shape: dict, retain: float, tokens: int):
    torch.manual_seed(0)
    layer = LRMoE(**shape, retain=retain, selection="top").cuda().bfloat16()
    x = torch.randn(tokens, shape["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer(x).sum().backward()
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    return step


def host_and_wall(step, n: int = 10) -> tuple[float, float]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    args = parser.parse_args()
    print(f"# eager LRMoE, {args.shape}, bf16, top selection, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    print(f"{'tokens':>7} {'retain':>6} {'host ms/step':>13} {'wall ms/step':>13} {'GPU activities':>15}")
    for tokens in args.tokens:
        for retain in args.retain:
            step = make_step(SHAPES[args.shape], retain, tokens)
            host, wall = host_and_wall(step)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            launches = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"{tokens:>7} {retain:>6g} {host:>13.3f} {wall:>13.3f} {launches:>15}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/eager_host.py needs a CUDA device")
    main()
