"""The sync check the GPU tests rely on must be able to fail: a check that never raises would pass them all."""

from __future__ import annotations

import pytest
import torch
from cuda_sync import no_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_host_sync_inside_raises_and_the_mode_is_restored():
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"):
        with no_host_sync():
            x.sum().item()  # a device-to-host copy: the host waits
    assert torch.cuda.get_sync_debug_mode() == 0
    assert x.sum().item() == 4.0  # and outside the block it does not raise


def test_device_work_inside_does_not_raise():
    x = torch.randn(64, 64, device="cuda")
    with no_host_sync():
        y = torch.cumsum(x @ x, 0)  # kernels only
    torch.testing.assert_close(y, torch.cumsum(x @ x, 0))
