"""A small torchtitan-style training loop for :class:`lrmoe.demo.model.MoELM`.

AdamW, linear warmup then cosine decay, gradient clipping, optional ``torch.compile``, seeded so that a run is
reproducible: the same seed gives the same initial weights, the same batches in the same order and, on one
device with one thread count, the same losses. The loop only synchronises with the device on logging steps; the
per-step values (loss, gradient norm, LRMoE statistics) stay tensors until the end of the run. Runs to compare
train interleaved, a step of each in turn (:func:`interleave`), so that their step times share the machine's load.

Shapes: B batch, L sequence length (``_BL1``: L + 1 bytes, inputs plus the shifted targets), V vocab, S steps.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["TrainConfig", "StepMetrics", "Run", "lr_factor", "evaluate", "warmup", "train", "interleave"]


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
    bwd_rows = sum(s.retained_pairs if layer.backward.backward_capacity is None or layer.retain >= 1.0 else
                   layer.num_experts * backward_capacity_rows(n_tokens, layer.top_k, layer.num_experts, layer.retain,
                                                              layer.backward.backward_capacity)
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
    library, kernel and allocator warm-up). Paying them here, outside any timed run, keeps the step times of
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
    ``score_mass_fraction`` = means over steps, ``ms_per_step``) and ``history``: one record per step (step,
    loss, lr, grad_norm, retained_fraction, score_mass_fraction).
    """
    return interleave([Run(model_cfg, train_cfg, corpus, log)])[0]


def interleave(runs: list[Run]) -> list[dict]:
    """Train ``runs`` a step of each in turn (run 0's step 1, run 1's step 1, ..., run 0's step 2, ...) and return
    their results, in order.

    Runs compared side by side share whatever load the machine is under: a burst of other work slows the steps of
    every run alike, instead of all the steps of whichever run was training then, so the runs' ``ms_per_step``
    compare. Each run keeps its own RNG state, so a run computes the same losses interleaved as alone.
    """
    while not all(run.done for run in runs):
        for run in runs:
            if not run.done:
                run.step()
    return [run.result() for run in runs]


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


class _StepTimer:
    """Time spent inside a run's own training steps: the host clock on a CPU; on a GPU, CUDA events around each
    step (no host sync per step; :meth:`seconds` waits for the last one)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def __call__(self):
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            start = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - start

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        return self._seconds


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class Run:
    """One training run, advanced a step at a time by :meth:`step` (:func:`interleave` alternates several), its
    summary from :meth:`result` once :attr:`done`.

    The model is built and the initial held-out loss measured here. The run seeds and keeps an RNG state of its
    own, swapped in for each step inside :func:`torch.random.fork_rng`: the caller's RNG state is left untouched,
    and runs interleaved with each other compute what they compute alone. ``ms_per_step`` counts the time inside
    the run's own steps (forward, backward, optimiser), not evaluations.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        corpus: Corpus,
        log: Callable[[dict], None] | None = None,
    ):
        self.model_cfg, self.train_cfg, self._log = model_cfg, train_cfg, log
        self.device = device = torch.device(train_cfg.device)
        with torch.random.fork_rng(devices=_rng_devices(device), device_type=device.type):
            torch.manual_seed(train_cfg.seed)
            self.model = MoELM(model_cfg).to(device)
            if train_cfg.init_checkpoint is not None:
                self.model.load_state_dict(torch.load(train_cfg.init_checkpoint, map_location=device,
                                                      weights_only=True))
            self._optimizer = _build_optimizer(self.model, train_cfg)
            self._scheduler = torch.optim.lr_scheduler.LambdaLR(self._optimizer,
                                                                 lambda step: lr_factor(step, train_cfg))
            self._step_fn = torch.compile(self.model) if train_cfg.compile else self.model
            self._data_gen = torch.Generator().manual_seed(train_cfg.seed)
            self._eval_set = heldout_batches(corpus.heldout_N, train_cfg.batch_size, train_cfg.seq_len,
                                             train_cfg.eval_batches)
            self.initial_heldout_loss = evaluate(self.model, self._eval_set, device)
            self._rng = _rng_state(device)
        self._train_N = corpus.train_N
        self._metrics_S: list[StepMetrics] = []
        self._lr_S: list[float] = []
        self._eval_curve = [(0, self.initial_heldout_loss)]
        n_layers = len(list(lrmoe_layers(self.model)))
        self._loads_LE = torch.zeros(n_layers, model_cfg.num_experts, dtype=torch.int64, device=device)
        self._quotas_LE = torch.zeros_like(self._loads_LE)
        self._timer = _StepTimer(device)
        self.steps_done = 0

    @property
    def done(self) -> bool:
        return self.steps_done >= self.train_cfg.steps

    def step(self) -> None:
        """One training step (and the held-out evaluation or the log call that falls on it)."""
        cfg, device = self.train_cfg, self.device
        step = self.steps_done + 1
        with torch.random.fork_rng(devices=_rng_devices(device), device_type=device.type):
            _set_rng_state(device, self._rng)
            with self._timer():
                batch_BL1 = sample_batch(self._train_N, cfg.batch_size, cfg.seq_len, self._data_gen).to(device)
                self._lr_S.append(self._scheduler.get_last_lr()[0])
                metrics, stats = _train_step(self.model, self._step_fn, self._optimizer, self._scheduler,
                                             batch_BL1, cfg)
                self._metrics_S.append(metrics)
                self._loads_LE += stats.loads_LE
                self._quotas_LE += stats.quotas_LE
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                self._eval_curve.append((step, evaluate(self.model, self._eval_set, device)))
            self._rng = _rng_state(device)
        self.steps_done = step
        if self._log is not None and (step % cfg.log_every == 0 or step == cfg.steps):
            ms_per_step = 1000.0 * self._timer.seconds() / step
            tokens_per_s = cfg.batch_size * cfg.seq_len * 1000.0 / max(ms_per_step, 1e-9)
            self._log(_progress_record(self.model_cfg.retain, step, cfg.steps, self._lr_S[-1], metrics, ms_per_step,
                                       tokens_per_s))

    def result(self) -> dict:
        """The final held-out evaluation (and checkpoint, if asked for) and the run's summary; see :func:`train`."""
        if not self.done:
            raise RuntimeError(f"the run has trained {self.steps_done} of its {self.train_cfg.steps} steps")
        model_cfg, train_cfg = self.model_cfg, self.train_cfg
        ms_per_step = 1000.0 * self._timer.seconds() / max(1, train_cfg.steps)
        heldout_loss = evaluate(self.model, self._eval_set, self.device)
        eval_curve = [*self._eval_curve, (train_cfg.steps, heldout_loss)]
        if train_cfg.save_checkpoint is not None:
            torch.save(self.model.state_dict(), train_cfg.save_checkpoint)
        history = _history(self._metrics_S, self._lr_S)
        tail = history[-min(train_cfg.log_every, len(history)) :]
        return {
            "retain": model_cfg.retain,
            "backward_capacity": model_cfg.backward_capacity,
            "selection": model_cfg.selection,
            "metric": model_cfg.metric,
            "steps": train_cfg.steps,
            "train_loss": _mean([r["loss"] for r in tail], skip_nan=False),
            "initial_heldout_loss": self.initial_heldout_loss,
            "heldout_loss": heldout_loss,
            "heldout_ppl": math.exp(heldout_loss) if math.isfinite(heldout_loss) else float("nan"),
            "retained_fraction": _mean([r["retained_fraction"] for r in history], skip_nan=False),
            "bwd_rows_per_step": _mean([r["bwd_rows"] for r in history], skip_nan=False),
            "eval_curve": [{"step": s, "heldout_loss": v} for s, v in eval_curve],
            "mean_expert_loads": (self._loads_LE.double() / max(1, train_cfg.steps)).cpu().tolist(),
            "mean_expert_quotas": (self._quotas_LE.double() / max(1, train_cfg.steps)).cpu().tolist(),
            "score_mass_fraction": _mean([r["score_mass_fraction"] for r in history], skip_nan=True),
            "ms_per_step": ms_per_step,
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
