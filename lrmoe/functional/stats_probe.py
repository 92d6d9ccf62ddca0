"""The backward-statistics probe: how a selective backward reports what it kept without a host read or a side
channel. A probe is a leaf tensor requiring grad, handed to the step (``selective_swiglu_experts``'
``stats_probe``); the step's backward returns its statistics as the probe's gradient, so autograd adds them to
``probe.grad`` over every backward until it is reset: sums, on the device, with no sync until read.

:class:`ProbeLayout` names the statistics a transport writes, in order (``Transport.probe_grad`` packs them with
it); :class:`StatsProbe` is the probe a module holds (LRMoE and SwiGLUExperts, expert parallelism, the torchtitan
integration), read back by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ProbeLayout", "StatsProbe"]


@dataclass(frozen=True)
class ProbeLayout:
    """The statistics a backward adds to a probe's gradient: their ``names`` in the probe's order, and its
    ``dtype`` (float64 where byte counts must stay exact past 2**24)."""

    names: tuple[str, ...]
    dtype: torch.dtype

    @property
    def size(self) -> int:
        return len(self.names)

    def pack(self, **values: torch.Tensor | float) -> torch.Tensor:
        """One backward's statistics, by name (0-d tensors, or Python numbers written by fills, not copied from
        host memory), as the probe's gradient: [size] in the layout's dtype and order."""
        if values.keys() != set(self.names):
            raise ValueError(f"a probe of layout {self.names} takes exactly these statistics, got {sorted(values)}")
        device = next(v.device for v in values.values() if isinstance(v, torch.Tensor))
        return torch.stack([values[name].to(self.dtype) if isinstance(values[name], torch.Tensor)
                            else torch.full((), values[name], dtype=self.dtype, device=device)
                            for name in self.names])


class StatsProbe:
    """A module's backward-statistics probe: ``tensor``, a [layout.size] leaf requiring grad whose ``.grad`` the
    backwards through the module add their statistics to. It is neither a parameter nor a buffer (its .grad must
    reach no optimiser and no state_dict), so its module moves it along in ``_apply`` (``follow``): created inside
    a forward it would be a tensor made with requires_grad=True, which breaks torch.compile's graph."""

    def __init__(self, layout: ProbeLayout, device: torch.device | str | None = None):
        self.layout = layout
        self.tensor = self._new(device)

    def _new(self, device) -> torch.Tensor:
        return torch.zeros(self.layout.size, dtype=self.layout.dtype, device=device, requires_grad=True)

    def follow(self, device: torch.device) -> torch.Tensor:
        """The probe on ``device``: a fresh one (zero, its sums forgotten) when it is elsewhere."""
        if self.tensor.device != device:
            self.tensor = self._new(device)
        return self.tensor

    def totals(self) -> dict[str, torch.Tensor]:
        """The statistics summed over the backwards since the last ``reset``, by name: 0-d tensors (copies, so a
        later backward leaves them as read), zeros before any backward."""
        acc = self.tensor.grad
        acc = torch.zeros_like(self.tensor, requires_grad=False) if acc is None else acc.detach().clone()
        return dict(zip(self.layout.names, acc.unbind(), strict=True))

    def reset(self) -> None:
        """Forget the sums."""
        self.tensor.grad = None
