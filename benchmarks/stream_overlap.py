"""Do the backward's last three expert GEMMs run faster side by side on two CUDA streams? (GPU, bf16)

    PYTHONPATH=. python3 benchmarks/stream_overlap.py [--shape qwen3] [--retain 1 0.75 0.5] [--rounds 3]

After the SwiGLU backward, the compact expert backward (lrmoe.functional.experts.expert_rows_backward) runs three
grouped GEMMs that need nothing of each other: the down projection's weight gradient (lrmoe::grouped_outer of dy and
phi), the gate/up weight gradient (lrmoe::grouped_outer of dh and the gathered input rows) and the input gradient
(lrmoe::gather_grouped_mm of dh and the gate/up weight), followed by the per-token sum of the input gradient's rows
(lrmoe::gather_sum_rows). One stream runs them one after another; a weight gradient at a short K (a few hundred rows
per expert) writes its whole [E, O, I] output at the end of each tile, which other work could hide. Each variant
below runs the same ops, the side stream forked from and joined back to the caller's stream with events (no host
synchronisation):
- "one stream": grad_down, grad_gu, dx, sum (the library's order);
- "dx | down, gu": dx and the sum on the caller's stream, both weight gradients on a side stream;
- "dx, down | gu": dx, the sum and grad_down on the caller's stream, grad_gu on the side stream;
- "three streams": grad_down and grad_gu on a side stream each.
Rows: per-expert loads from a router with random logits (T tokens each pick top_k distinct experts), each expert
keeping its first round(retain * load) pairs, as a balanced plan keeps. Each variant's results must equal the
one-stream results exactly (same kernels, same inputs) before it is timed.
Times: "graph", each variant captured in a CUDA graph and replayed (scoring_bandwidth.graph_ms: GPU time; the graph
keeps the streams' fork and join), and "eager", the ops launched from Python (events around each call); medians over
the replays, then the median over --rounds rounds that time the variants in turn. Importable on a CPU machine;
main() needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from scoring_bandwidth import graph_ms

from lrmoe.ops import gather_grouped_mm, gather_sum_rows, grouped_outer

SHAPES = {"qwen3": (8192, 128, 8, 2048, 768), "glm-4.5-air": (8192, 128, 8, 4096, 1408)}  # T, E, K, d, f


def make_problem(shape: str, retain: float, device: str = "cuda") -> dict:
    n_tok, n_exp, top_k, dim, ffn = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    ids_TK = torch.randn(n_tok, n_exp, generator=gen).topk(top_k, dim=1).indices
    flat_P = ids_TK.reshape(-1)
    order_P = torch.argsort(flat_P, stable=True)
    loads_E = torch.bincount(flat_P, minlength=n_exp)
    keep_E = torch.round(retain * loads_E.double()).long()
    rank_P = torch.arange(flat_P.shape[0]) - torch.repeat_interleave(loads_E.cumsum(0) - loads_E, loads_E)
    pair_R = order_P[rank_P < torch.repeat_interleave(keep_E, loads_E)]
    n_rows = pair_R.shape[0]
    slot_P = torch.full((flat_P.shape[0],), -1, dtype=torch.long)
    slot_P[pair_R] = torch.arange(n_rows)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).bfloat16().to(device)

    return dict(
        x_TD=rand(n_tok, dim), gate_up_EFD=rand(n_exp, 2 * ffn, dim, scale=dim**-0.5),
        dy_RD=rand(n_rows, dim), phi_RF=rand(n_rows, ffn), dh_RF2=rand(n_rows, 2 * ffn),
        tok_R=(pair_R // top_k).to(device), offsets_E=keep_E.cumsum(0).int().to(device),
        slot_TK=slot_P.view(n_tok, top_k).to(device), rows=n_rows, loads_E=loads_E, ids_TK=ids_TK,
        pair_R=pair_R,
        flop=2 * n_rows * (dim * ffn + 2 * ffn * dim + 2 * ffn * dim),
    )


def ops(p: dict) -> dict:
    return {
        "down": lambda: grouped_outer(p["dy_RD"], p["phi_RF"], None, p["offsets_E"]),
        "gu": lambda: grouped_outer(p["dh_RF2"], p["x_TD"], p["tok_R"], p["offsets_E"]),
        "dx": lambda: gather_sum_rows(
            gather_grouped_mm(p["dh_RF2"], p["gate_up_EFD"].transpose(1, 2), None, p["offsets_E"]), p["slot_TK"]),
    }


# variant: lists of op names, the first on the caller's stream, each other on a side stream of its own
VARIANTS = {
    "one stream": [["down", "gu", "dx"]],
    "dx | down, gu": [["dx"], ["down", "gu"]],
    "dx, down | gu": [["dx", "down"], ["gu"]],
    "three streams": [["dx"], ["down"], ["gu"]],
}


def run_variant(fns: dict, lanes: list[list[str]], side: list[torch.cuda.Stream]) -> dict:
    main = torch.cuda.current_stream()
    fork = torch.cuda.Event()
    fork.record(main)
    out = {}
    for stream, names in zip(side, lanes[1:]):
        stream.wait_event(fork)
        with torch.cuda.stream(stream):
            out.update({n: fns[n]() for n in names})
    side_outputs = list(out.values())
    out.update({n: fns[n]() for n in lanes[0]})
    for stream in side[: len(lanes) - 1]:
        main.wait_stream(stream)
    for t in side_outputs:  # allocated on a side stream, used and freed on the caller's: tell the allocator
        t.record_stream(main)
    return out


def events_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("stream_overlap.py needs CUDA")
        return
    side = [torch.cuda.Stream() for _ in range(2)]
    print(f"{args.shape}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| retain | rows | variant | graph ms | eager ms | vs one stream (graph) | TFLOP/s (graph) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for retain in args.retain:
        p = make_problem(args.shape, retain)
        fns = ops(p)
        want = run_variant(fns, VARIANTS["one stream"], side)
        for name, lanes in VARIANTS.items():
            got = run_variant(fns, lanes, side)
            torch.cuda.synchronize()
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            if bad:
                raise AssertionError(f"{name}: {bad} differ from one stream")
        times = {name: ([], []) for name in VARIANTS}
        for r in range(args.rounds):
            names = list(VARIANTS)
            names = names[r % len(names):] + names[: r % len(names)]
            for name in names:
                call = lambda lanes=VARIANTS[name]: run_variant(fns, lanes, side)  # noqa: E731
                times[name][0].append(graph_ms(call, [()]))
                times[name][1].append(events_ms(call))
        base = statistics.median(times["one stream"][0])
        for name, (graph, eager) in times.items():
            g = statistics.median(graph)
            print(f"| {retain} | {p['rows']} | {name} | {g:.3f} | {statistics.median(eager):.3f} | "
                  f"{base / g:.3f} | {p['flop'] / g / 1e9:.0f} |")


if __name__ == "__main__":
    main()
