"""Shared test configuration.

Hypothesis profiles: "ci" (the default) keeps every property test small and fast so the whole suite runs in
minutes on two CPU cores; "dev" explores more examples. Pick one with HYPOTHESIS_PROFILE=dev.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
