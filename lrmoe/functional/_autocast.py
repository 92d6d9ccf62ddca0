"""torch.autocast queries that also answer for device types autocast does not know (the meta device: a model
built with ``torch.device("meta")`` for deferred initialisation, or its shapes traced without memory), where
torch.is_autocast_enabled and torch.autocast raise. Autocast is never on there, so nothing is cast."""

from __future__ import annotations

import contextlib

import torch


def autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled(device_type), False on the meta device, which autocast does not support. A plain
    comparison, not torch.amp.is_autocast_available: torch 2.11's Dynamo cannot trace that (a graph break in
    every compiled layer)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)``, or no context where autocast does not exist (meta)."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
