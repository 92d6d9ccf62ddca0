"""What LRMoE's backward keeps, without timing anything (CPU).

    python benchmarks/plans.py capacity [--shape glm-4.5-air] [--skew 0 0.25 0.5 1] [--factor 1 1.25 1.5]
    python benchmarks/plans.py dropped-pairs [--steps 300] [--retain 0.75] [--preset default]
    python benchmarks/plans.py dropped-pairs --preset study --init runs/study/checkpoints/dense-scratch-seed0.pt

``capacity``: what LRMoE's ``backward_capacity`` keeps and pads, by router skew. With ``backward_capacity=c`` every
expert keeps at most C = ceil(c * floor(retain * P) / E) pairs (rounded up to 8) and the backward's four GEMMs run
as torch.bmm over E blocks of C rows; without it, the plain waterfill plan keeps the whole budget and the GEMMs run
grouped, in 128-row tiles per expert. The router is the one benchmarks/layer.py times with ``--skew``: an LRMoE
layer's gate as initialised under seed 0, expert e's logit biased by skew * sigma * z_e (common.skew_router), bf16,
on random tokens (drawn here on the CPU, so the loads differ from the GPU run's by sampling noise; max / mean load
is printed to compare). Per skew, retain and c:

* kept / budget: pairs the capped plan keeps, as a share of floor(retain * P) (the plain plan keeps all of it);
* pad: zero rows of the E * C blocks, as a share of E * C (work the batched GEMMs do for nothing);
* rows / plain: E * C against the plain plan's rows rounded up to whole 128-row tiles per expert (the row count
  torch._grouped_mm's tiles cover): below 1, the blocked backward also does less GEMM work.

``dropped-pairs``: which token-expert pairs does each selection rule drop? Trains the demo model of --preset with
the dense backward for --steps (the same run as `python -m lrmoe demo --retain 1.0 --steps N`), or loads a
dense-trained checkpoint of that preset (--init, e.g. the quality study's pretraining run), then on --batches fixed
training batches captures every LRMoE layer's input and output gradient,
recomputes what its backward would see (gates α, ‖φ‖², g) and asks, per metric and rule, which pairs are kept:

* kept fraction of first-choice pairs (the token's highest gate) and of lower-ranked choices: for "top" the share
  actually kept, for "sample" the expected share (mean inclusion probability);
* mean gate of the kept and of the dropped pairs;
* tokens that lose every one of their pairs.

Prints one table. The question it answers (docs/quality.md): does top-quota selection systematically drop the same
kind of pair (small gate, secondary choice) while sampling spreads its drops?
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from common import SHAPES, skew_router
from torch import nn

from lrmoe.demo.cli import _PRESETS
from lrmoe.demo.data import load_corpus, sample_batch
from lrmoe.demo.model import MoELM, lrmoe_layers
from lrmoe.demo.train import train
from lrmoe.functional import inclusion_probabilities, plan_quotas, route_topk, score_pairs, select_within_quota
from lrmoe.functional.experts import backward_capacity_rows
from lrmoe.functional.routing import expert_loads

# ---------------------------------------------------------------------------------------------------- capacity


def loads_for(shape: dict, tokens: int, skew: float) -> torch.Tensor:
    """Expert loads of benchmarks/layer.py's router (LRMoE creates its gate first, so seed 0 gives the same weights)."""
    torch.manual_seed(0)
    router = nn.Module()
    router.gate = nn.Linear(shape["dim"], shape["num_experts"], bias=False).bfloat16()
    x_TD = torch.randn(tokens, shape["dim"], dtype=torch.bfloat16)
    if skew:
        skew_router(router, skew, seed=0)
        x_TD[:, 0] = 1.0
    with torch.no_grad():
        ids_TK = router.gate(x_TD).float().topk(shape["top_k"], dim=-1).indices
    return expert_loads(ids_TK, shape["num_experts"])


def capacity(args) -> None:
    shape = SHAPES[args.shape]
    T, E, K = args.tokens, shape["num_experts"], shape["top_k"]
    print(f"# {args.shape}, T={T}, E={E}, k={K}: P={T * K} pairs; plans only")
    print(f"{'skew':>5} {'max/mean load':>13} {'retain':>6} {'c':>5} {'C':>5} {'kept/budget':>11} {'pad':>6} "
          f"{'rows/plain':>10}")
    for skew in args.skew:
        loads_E = loads_for(shape, T, skew)
        ratio = loads_E.max().item() / loads_E.float().mean().item()
        for retain in args.retain:
            budget = int(retain * T * K)
            plain_E = plan_quotas(loads_E, retain)
            plain_rows = int(((plain_E + 127) // 128 * 128).sum())
            for factor in args.factor:
                cap = backward_capacity_rows(T, K, E, retain, factor)
                kept = int(plan_quotas(loads_E, retain, capacity=torch.full_like(loads_E, cap)).sum())
                print(f"{skew:5.2f} {ratio:13.2f} {retain:6.2f} {factor:5.2f} {cap:5d} {kept / budget:11.3f} "
                      f"{1 - kept / (E * cap):6.3f} {E * cap / plain_rows:10.3f}")


# ----------------------------------------------------------------------------------------------- dropped pairs


def capture(model: MoELM, batch_BL1: torch.Tensor) -> list[dict]:
    """Per LRMoE layer: its input x_TD and the gradient g_TD at its output for this batch's loss."""
    records: list[dict] = []
    handles = []

    def hook(layer, inputs, output):
        record = {"layer": layer, "x": inputs[0].detach().reshape(-1, layer.dim)}
        output.register_hook(lambda g: record.__setitem__("g", g.detach().reshape(-1, layer.dim)))
        records.append(record)

    for layer in lrmoe_layers(model):
        handles.append(layer.register_forward_hook(hook))
    logits = model(batch_BL1[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch_BL1[:, 1:].flatten()).backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return records


@torch.no_grad()
def pair_view(record: dict) -> dict:
    """Gates, expert ids, choice rank and ‖φ‖² of every pair of one layer's batch."""
    layer, x_TD = record["layer"], record["x"]
    routing = route_topk(layer.gate(x_TD), layer.top_k, score_func=layer.routing.score_func,
                         norm_topk_prob=layer.routing.norm_topk_prob)
    gate, up = torch.einsum("td,tkfd->tkf", x_TD, layer.experts.gate_up_proj[routing.expert_ids]).chunk(2, -1)
    phi_sq_TK = (torch.nn.functional.silu(gate) * up).square().sum(-1)
    return {"gates": routing.gates, "experts": routing.expert_ids, "phi_sq": phi_sq_TK, "g": record["g"],
            "num_experts": layer.num_experts}


def kept_share(view: dict, metric: str, rule: str, retain: float) -> torch.Tensor:
    """[T, K] probability that each pair is kept (0/1 for "top", the inclusion probability for "sample")."""
    scores_TK = score_pairs(view["gates"], view["g"], view["phi_sq"], metric=metric)
    flat_e = view["experts"].reshape(-1)
    loads = torch.zeros(view["num_experts"], dtype=torch.int64).scatter_add_(0, flat_e, torch.ones_like(flat_e))
    quotas = plan_quotas(loads, retain)
    if rule == "sample":
        return inclusion_probabilities(scores_TK.reshape(-1), flat_e, quotas).float().view_as(scores_TK)
    sel = select_within_quota(scores_TK.reshape(-1), flat_e, quotas, max_rows=flat_e.numel(), mode="top")
    kept = torch.zeros(flat_e.numel())
    kept[sel.pair_ids[sel.pair_ids >= 0]] = 1.0
    return kept.view_as(scores_TK)


def dropped_pairs(args) -> None:
    model_cfg, train_cfg, max_bytes = _PRESETS[args.preset]
    corpus = load_corpus("python", max_bytes)
    model = MoELM(replace(model_cfg, retain=1.0))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.init
        if ckpt is None:
            ckpt = str(Path(tmp) / "dense.pt")
            train(replace(model_cfg, retain=1.0), replace(train_cfg, steps=args.steps, save_checkpoint=ckpt,
                                                           eval_every=0, device=args.device), corpus)
        model.load_state_dict(torch.load(ckpt, weights_only=True, map_location="cpu"))

    gen = torch.Generator().manual_seed(1234)
    views = []
    for _ in range(args.batches):
        batch = sample_batch(corpus.train_N, train_cfg.batch_size, train_cfg.seq_len, gen)
        views += [pair_view(r) for r in capture(model, batch)]

    source = args.init or f"dense-trained {args.steps} steps"
    print(f"# demo {args.preset} model ({source}), E = {model_cfg.num_experts}, {len(views)} layer-batches, "
          f"retain {args.retain}, k = {model_cfg.top_k}")
    print(f"{'metric':>9} {'rule':>7} {'kept 1st':>9} {'kept 2nd+':>9} {'gate kept':>9} {'gate drop':>9} "
          f"{'tokens all dropped':>18}")
    for metric in ("lrm", "grad_l2", "grad_abs", "random"):
        for rule in ("top", "sample"):
            if metric == "random" and rule == "sample":
                continue
            first = rest = gate_kept = gate_drop = none = n_tok = 0.0
            n_first = n_rest = mass_kept = mass_drop = 0.0
            for view in views:
                torch.manual_seed(0)
                share = kept_share(view, metric, rule, args.retain)
                gates = view["gates"]
                order = gates.argsort(dim=-1, descending=True)
                is_first = torch.zeros_like(share, dtype=torch.bool).scatter_(1, order[:, :1], True)
                first += share[is_first].sum().item()
                n_first += is_first.sum().item()
                rest += share[~is_first].sum().item()
                n_rest += (~is_first).sum().item()
                gate_kept += (share * gates).sum().item()
                mass_kept += share.sum().item()
                gate_drop += ((1 - share) * gates).sum().item()
                mass_drop += (1 - share).sum().item()
                none += (1 - share).prod(dim=-1).sum().item()  # expected, for sample; exact for top
                n_tok += share.shape[0]
            print(f"{metric:>9} {rule:>7} {first / n_first:>9.3f} {rest / n_rest:>9.3f} "
                  f"{gate_kept / mass_kept:>9.3f} {gate_drop / max(mass_drop, 1e-9):>9.3f} {none / n_tok:>18.3f}")


# --------------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("capacity", help="what backward_capacity keeps and pads, by router skew")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--skew", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    p.add_argument("--retain", type=float, nargs="+", default=[0.75, 0.5])
    p.add_argument("--factor", type=float, nargs="+", default=[1.0, 1.25, 1.5])
    p = sub.add_parser("dropped-pairs", help="which pairs each selection rule drops (the demo model)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--retain", type=float, default=0.75)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--preset", default="default", choices=sorted(_PRESETS))
    p.add_argument("--init", help="a dense-trained checkpoint of --preset's model (skips the training run)")
    p.add_argument("--device", default="cpu", help="device of the training run (the analysis runs on CPU)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    {"capacity": capacity, "dropped-pairs": dropped_pairs}[args.command](args)


if __name__ == "__main__":
    main()
