"""The benchmark report's target verdicts (pure logic on recorded medians)."""

from __future__ import annotations

import pytest

from benchmarks.report import target_status

RATIO = {"kind": "ratio_le", "value": 0.5, "text": "<= 0.5x torchrun"}


@pytest.mark.parametrize("elaunch, torchrun, verdict", [
    (0.05, 0.2, "met"),
    (0.15, 0.2, "not met"),
    (0.1, None, "met"),  # torchrun never completed
    (0.0, 0.0, "met"),  # a short window where neither used measurable CPU (was a ZeroDivisionError)
    (0.01, 0.0, "not met"),
])
def test_ratio_target(elaunch, torchrun, verdict):
    metric = {"target": RATIO, "median": {"elaunch": elaunch, "torchrun": torchrun}}
    assert target_status(metric, {}) == verdict
