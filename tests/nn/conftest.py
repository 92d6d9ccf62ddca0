"""Fixtures shared by the layer tests."""

from __future__ import annotations

import pytest
from layer_step import forward_backward


@pytest.fixture
def fwd_bwd():
    return forward_backward
