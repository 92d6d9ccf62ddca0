"""A small torchtitan-style training loop for :class:`lrmoe.demo.model.MoELM`.

AdamW, linear warmup then cosine decay, gradient clipping, optional ``torch.compile``, seeded so that a run is
reproducible: the same seed gives the same initial weights, the same batches in the same order and, on one
device with one thread count, the same losses. The loop only synchronises with the device on logging steps; the
per-step values (loss, gradient norm, LRMoE statistics) stay tensors until the end of the run.

Shapes: B batch, L sequence length (``_BL1``: L + 1 bytes, inputs plus the shifted targets), V vocab, S steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lrmoe.demo.data import Corpus, heldout_batches, sample_batch
from lrmoe.demo.model import ModelConfig, MoELM, lrmoe_layers
from lrmoe.functional.experts import backward_capacity_rows

__all__ = ["TrainConfig", "StepMetrics", "lr_factor", "evaluate", "warmup", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and run settings."""

    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    compile: bool = False
    eval_batches: int = 8
    log_every: int = 10
    eval_every: int = 0  # held-out evaluation every this many steps (0: only before and after training)
    init_checkpoint: str | None = None  # start from these weights (continued training), else a fresh init
    save_checkpoint: str | None = None  # write the final weights here


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimiser step ``step`` (0-based): linear warmup to 1, cosine to min_lr_ratio."""
    warmup = max(1, min(cfg.warmup_steps, cfg.steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def _build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms); the tied embedding is a matrix too."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def _lm_loss(model: nn.Module, batch_BL1: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of a [B, L+1] window batch."""
    logits_BLV = model(batch_BL1[:, :-1])
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), batch_BL1[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean loss over fixed, equally sized batches (a host sync; called outside the training loop)."""
    was_training = model.training
    model.eval()
    losses = torch.stack([_lm_loss(model, batch_BL1.to(device)) for batch_BL1 in batches])
    model.train(was_training)
    return losses.mean().item()


@dataclass(frozen=True)
class _LayerStats:
    """One step's LRMoE statistics over all layers, as tensors (no host sync)."""

    retained_fraction: torch.Tensor  # 0-d: retained pairs / routed pairs, all layers
    score_mass_fraction: torch.Tensor  # 0-d: mean over layers
    bwd_rows: torch.Tensor  # 0-d: rows the backward expert GEMMs processed, all layers
    loads_LE: torch.Tensor  # [layers, E] pairs routed to each expert
    quotas_LE: torch.Tensor  # [layers, E] pairs each expert kept in backward


def _step_stats(model: nn.Module, batch_BL1: torch.Tensor) -> _LayerStats:
    """The last step's statistics of every LRMoE layer (the step's batch gives the tokens per layer call), then
    reset their backward statistics."""
    n_tokens = batch_BL1.shape[0] * (batch_BL1.shape[1] - 1)  # inputs are batch[:, :-1]
    layers = list(lrmoe_layers(model))
    stats = [layer.stats() for layer in layers]
    retained = torch.stack([s.retained_pairs for s in stats]).sum()
    # Rows the expert backward's GEMMs run: the retained pairs, or with backward_capacity E padded blocks of C.
    bwd_rows = sum(s.retained_pairs if layer.backward_capacity is None or layer.retain >= 1.0 else
                   layer.num_experts * backward_capacity_rows(n_tokens, layer.top_k, layer.num_experts, layer.retain,
                                                              layer.backward_capacity)
                   for layer, s in zip(layers, stats))
    total = torch.stack([s.total_pairs for s in stats]).sum()
    mass = torch.stack([s.score_mass_fraction.float() for s in stats]).nanmean()
    for layer in layers:
        layer.reset_stats()
    return _LayerStats(
        retained_fraction=retained.double() / total.clamp(min=1).double(),
        score_mass_fraction=mass.double(),
        bwd_rows=torch.as_tensor(bwd_rows, device=retained.device),
        loads_LE=torch.stack([s.loads for s in stats]),
        quotas_LE=torch.stack([s.quotas for s in stats]),
    )


def _rng_devices(device: torch.device) -> list[int]:
    """Devices whose RNG ``fork_rng`` saves besides the CPU's: the CUDA device in use, if any."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def warmup(model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
    """One throwaway training step of a fresh model on random bytes.

    The first step in a process pays one-off costs (lazy imports of torch internals by the optimizer and the
    library, kernel and allocator warm-up). Paying them here, outside any timed run, keeps the wall times of
    compared runs comparable. Leaves the caller's RNG state untouched.
    """
    device = torch.device(train_cfg.device)
    with torch.random.fork_rng(devices=_rng_devices(device), device_type=device.type):
        model = MoELM(model_cfg).to(device)
        optimizer = _build_optimizer(model, train_cfg)
        batch_BL1 = torch.randint(model_cfg.vocab_size, (train_cfg.batch_size, train_cfg.seq_len + 1), device=device)
        _lm_loss(model, batch_BL1).backward()
        nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        optimizer.step()
        _step_stats(model, batch_BL1)
        evaluate(model, [batch_BL1], device)


def train(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    corpus: Corpus,
    log: Callable[[dict], None] | None = None,
) -> dict:
    """Train one model from scratch and evaluate it on fixed held-out batches.

    ``log`` is called every ``train_cfg.log_every`` steps (and at the last step) with the step's record. The
    global RNG is seeded inside :func:`torch.random.fork_rng`, so the caller's RNG state is left untouched.

    Returns a dict of summary numbers (``retain``, ``train_loss`` = mean of the last ``log_every`` steps,
    ``heldout_loss``, ``heldout_ppl``, ``initial_heldout_loss``, ``retained_fraction`` and
    ``score_mass_fraction`` = means over steps, ``wall_s``, ``ms_per_step``) and ``history``: one record per
    step (step, loss, lr, grad_norm, retained_fraction, score_mass_fraction).
    """
    device = torch.device(train_cfg.device)
    with torch.random.fork_rng(devices=_rng_devices(device), device_type=device.type):
        torch.manual_seed(train_cfg.seed)
        return _train_seeded(model_cfg, train_cfg, corpus, device, log)


@dataclass(frozen=True)
class StepMetrics:
    """One training step's numbers, as 0-d tensors on the training device (no host sync to produce)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    retained_fraction: torch.Tensor
    score_mass_fraction: torch.Tensor
    bwd_rows: torch.Tensor


def _train_step(
    model: nn.Module,
    step_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch_BL1: torch.Tensor,
    cfg: TrainConfig,
) -> tuple[StepMetrics, _LayerStats]:
    """Forward (through ``step_fn``, the maybe-compiled model), backward, clip, optimiser and schedule step."""
    loss = _lm_loss(step_fn, batch_BL1)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    stats = _step_stats(model, batch_BL1)
    return StepMetrics(loss.detach(), grad_norm.detach(), stats.retained_fraction, stats.score_mass_fraction,
                       stats.bwd_rows), stats


def _train_seeded(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    corpus: Corpus,
    device: torch.device,
    log: Callable[[dict], None] | None,
) -> dict:
    start = time.perf_counter()
    model = MoELM(model_cfg).to(device)
    if train_cfg.init_checkpoint is not None:
        model.load_state_dict(torch.load(train_cfg.init_checkpoint, map_location=device, weights_only=True))
    optimizer = _build_optimizer(model, train_cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train_cfg))
    step_fn = torch.compile(model) if train_cfg.compile else model
    data_gen = torch.Generator().manual_seed(train_cfg.seed)
    eval_set = heldout_batches(corpus.heldout_N, train_cfg.batch_size, train_cfg.seq_len, train_cfg.eval_batches)
    initial_heldout_loss = evaluate(model, eval_set, device)

    metrics_S: list[StepMetrics] = []
    lr_S: list[float] = []
    eval_curve = [(0, initial_heldout_loss)]
    n_layers = len(list(lrmoe_layers(model)))
    loads_LE = torch.zeros(n_layers, model_cfg.num_experts, dtype=torch.int64, device=device)
    quotas_LE = torch.zeros_like(loads_LE)
    loop_start = time.perf_counter()
    eval_s = 0.0
    for step in range(1, train_cfg.steps + 1):
        batch_BL1 = sample_batch(corpus.train_N, train_cfg.batch_size, train_cfg.seq_len, data_gen).to(device)
        lr_S.append(scheduler.get_last_lr()[0])
        metrics, stats = _train_step(model, step_fn, optimizer, scheduler, batch_BL1, train_cfg)
        metrics_S.append(metrics)
        loads_LE += stats.loads_LE
        quotas_LE += stats.quotas_LE
        if train_cfg.eval_every and step % train_cfg.eval_every == 0 and step < train_cfg.steps:
            eval_start = time.perf_counter()
            eval_curve.append((step, evaluate(model, eval_set, device)))
            eval_s += time.perf_counter() - eval_start
        if log is not None and (step % train_cfg.log_every == 0 or step == train_cfg.steps):
            ms_per_step = 1000.0 * (time.perf_counter() - loop_start - eval_s) / step
            tokens_per_s = train_cfg.batch_size * train_cfg.seq_len * 1000.0 / max(ms_per_step, 1e-9)
            log(_progress_record(model_cfg.retain, step, train_cfg.steps, lr_S[-1], metrics, ms_per_step,
                                 tokens_per_s))
    loop_s = time.perf_counter() - loop_start - eval_s

    heldout_loss = evaluate(model, eval_set, device)
    eval_curve.append((train_cfg.steps, heldout_loss))
    if train_cfg.save_checkpoint is not None:
        torch.save(model.state_dict(), train_cfg.save_checkpoint)
    wall_s = time.perf_counter() - start
    history = _history(metrics_S, lr_S)
    tail = history[-min(train_cfg.log_every, len(history)) :]
    return {
        "retain": model_cfg.retain,
        "backward_capacity": model_cfg.backward_capacity,
        "selection": model_cfg.selection,
        "metric": model_cfg.metric,
        "steps": train_cfg.steps,
        "train_loss": _mean([r["loss"] for r in tail], skip_nan=False),
        "initial_heldout_loss": initial_heldout_loss,
        "heldout_loss": heldout_loss,
        "heldout_ppl": math.exp(heldout_loss) if math.isfinite(heldout_loss) else float("nan"),
        "retained_fraction": _mean([r["retained_fraction"] for r in history], skip_nan=False),
        "bwd_rows_per_step": _mean([r["bwd_rows"] for r in history], skip_nan=False),
        "eval_curve": [{"step": s, "heldout_loss": v} for s, v in eval_curve],
        "mean_expert_loads": (loads_LE.double() / max(1, train_cfg.steps)).cpu().tolist(),
        "mean_expert_quotas": (quotas_LE.double() / max(1, train_cfg.steps)).cpu().tolist(),
        "score_mass_fraction": _mean([r["score_mass_fraction"] for r in history], skip_nan=True),
        "wall_s": wall_s,
        "ms_per_step": 1000.0 * loop_s / max(1, train_cfg.steps),
        "model_config": asdict(model_cfg),
        "train_config": asdict(train_cfg),
        "history": history,
    }


def _progress_record(
    retain: float, step: int, steps: int, lr: float, m: StepMetrics, ms_per_step: float, tokens_per_s: float
) -> dict:
    """The record passed to ``log`` on logging steps (a host sync)."""
    return {
        "retain": retain,
        "step": step,
        "steps": steps,
        "loss": m.loss.item(),
        "lr": lr,
        "grad_norm": m.grad_norm.item(),
        "retained_fraction": m.retained_fraction.item(),
        "score_mass_fraction": m.score_mass_fraction.item(),
        "ms_per_step": ms_per_step,
        "tokens_per_s": tokens_per_s,
    }


def _history(metrics_S: list[StepMetrics], lr_S: list[float]) -> list[dict]:
    """Per-step records, moving each column of step tensors to the host in one transfer."""
    if not metrics_S:
        return []
    names = ("loss", "grad_norm", "retained_fraction", "score_mass_fraction", "bwd_rows")
    columns = {name: torch.stack([getattr(m, name) for m in metrics_S]).double().cpu().tolist() for name in names}
    return [
        {"step": i + 1, "lr": lr, **{name: columns[name][i] for name in names}} for i, lr in enumerate(lr_S)
    ]


def _mean(values: list[float], *, skip_nan: bool) -> float:
    """Mean of ``values``; NaN if empty. With ``skip_nan`` NaNs are left out (a layer statistic that is undefined
    on some steps), otherwise they propagate (a diverged loss must show)."""
    kept = [v for v in values if not (skip_nan and math.isnan(v))]
    return sum(kept) / len(kept) if kept else float("nan")
