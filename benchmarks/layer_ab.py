"""One checkout's compiled layer against transformers' block, as one JSON line: run it alternately for two
checkouts (a commit before a change and after it) to compare them in interleaved processes on one GPU.

    git worktree add /tmp/before <commit>       # or any copy of the repository
    for tree in /tmp/before $PWD; do            # each tree installed into a folder of its own (no registry needed)
        pip install -q --no-deps --no-build-isolation --target /tmp/site-$(basename $tree) $tree; done
    for tree in /tmp/before $PWD $PWD /tmp/before; do
        PYTHONPATH=/tmp/site-$(basename $tree) python benchmarks/layer_ab.py --tag $tree; done

Each process builds LRMoE at every --retain (default selection) and transformers' Qwen3-MoE block, compiles them
(torch.compile, LRMoE with fullgraph=True), and times forward+backward from a fixed random output gradient with
CUDA events (triton.testing.do_bench, median over 200 ms) once a round, in a rotated order, for --rounds rounds;
it prints the median over rounds per layer and the ratio to transformers' block. The lrmoe it imported is in the
line ("lrmoe"), so a PYTHONPATH that did not take effect shows. The script's own folder holds no lrmoe, so
PYTHONPATH decides which one runs.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import lrmoe
from common import SHAPES, hf_block, require_cuda
from lrmoe.nn import LRMoE


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="", help="a label for the line (e.g. the checkout)")
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    require_cuda("benchmarks/layer_ab.py")
    from triton.testing import do_bench

    shape = SHAPES[args.shape]
    rows = [(f"retain {r:g}", lambda r=r: LRMoE(**shape, retain=r), True) for r in args.retain]
    rows.append(("transformers", lambda: hf_block(**shape), False))
    built = []
    for name, make, fullgraph in rows:
        torch.manual_seed(0)
        layer = make().cuda().bfloat16()
        x = torch.randn(args.tokens, shape["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)
        compiled = torch.compile(layer, fullgraph=fullgraph)

        def step(compiled=compiled, x=x, grad=grad):
            compiled(x).backward(grad)

        step()
        step()
        built.append((name, step, [x, *layer.parameters()], []))
    for r in range(args.rounds):
        start = r * len(built) // args.rounds
        for name, step, grads, ms in built[start:] + built[:start]:
            ms.append(do_bench(step, warmup=25, rep=200, return_mode="median", grad_to_none=grads))
            for t in grads:
                t.grad = None
    median = {name: statistics.median(ms) for name, _, _, ms in built}
    ratios = {name: median["transformers"] / ms for name, ms in median.items()}
    print(json.dumps({"tag": args.tag, "lrmoe": lrmoe.__file__, "torch": torch.__version__, "tokens": args.tokens,
                      "fwd_bwd_ms": median, "vs_transformers": ratios}), flush=True)


if __name__ == "__main__":
    main()
