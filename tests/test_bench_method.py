"""The statistic of scripts/bench_apps.py: what a step time leaves out, and what it keeps."""

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_apps  # noqa: E402


def test_steady_step_leaves_out_epoch_starts_and_tracing_steps():
    # two epochs of 5 steps: each epoch's first step also starts the epoch (3.5 s), and one
    # step traced a freeze group (9.4 s)
    steps = [3.5, 0.50, 0.40, 9.4, 0.60, 3.3, 0.45, 0.55, 0.50, 0.40]
    kept = [0.50, 0.40, 0.60, 0.45, 0.55, 0.50, 0.40]
    assert bench_apps.steady_step(steps, 5) == pytest.approx(statistics.fmean(kept))


def test_steady_step_is_a_mean_of_mixed_steps_not_their_median():
    # a freeze level: 7 full steps of 0.5 s and 3 partial steps of 0.2 s, in epochs of 11
    steps = [3.0] + [0.5] * 7 + [0.2] * 3
    assert bench_apps.steady_step(steps, 11) == pytest.approx((7 * 0.5 + 3 * 0.2) / 10)
    assert bench_apps.steady_step(steps, 11) < statistics.median(steps[1:])


@pytest.mark.parametrize("name", ["keras", "O0", "O0-noguard", "lessbn-gc", "freeze-p1", "group-0", "hand-9"])
def test_config_names(name):
    assert bench_apps.config_name(name) == name


@pytest.mark.parametrize("name", ["O3", "group-10", "hand-x", "group-", "Keras"])
def test_unknown_config_names_are_refused(name):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="unknown configuration"):
        bench_apps.config_name(name)
