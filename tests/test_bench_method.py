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


def test_steady_step_is_keras_boost_bench_statistic():
    from keras_boost.app import bench

    assert bench_apps.steady_step is bench.steady_step  # one statistic for both benchmarks
    assert bench.steady_step([], 5) is None and bench.steady_step([2.0], 1) is None  # no step after epoch starts


def test_keras_boost_bench_clock_records_the_steps_after_the_first_epoch():
    import keras
    import numpy as np

    from keras_boost.app.bench import _EpochClock

    rng = np.random.default_rng(0)
    x, y = rng.random((40, 3), dtype=np.float32), rng.integers(0, 2, 40)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    clock = _EpochClock((x, y))
    model.fit(x, y, batch_size=10, epochs=3, verbose=0, callbacks=[clock])
    assert clock.steps_per_epoch == 4 and len(clock.step_times) == 8  # epochs 2 and 3, 4 steps each
    assert len(clock.train_times) == 3 and len(clock.accuracies) == 3 and clock.first_step > 0


def test_bench_groups_assigns_each_step_its_freeze_group():
    import bench_groups
    import numpy as np

    # keras_boost's O1 sequence: 6 full steps, then groups 1, 2, 3; a step of group k takes
    # 0.5 - 0.1 k s here, its CPU time twice that; epochs of 9 steps, 2 epochs after the first
    sequence = bench_groups.sequence_of("O1")
    np.testing.assert_array_equal(sequence[:9], [0, 0, 0, 0, 0, 0, 1, 2, 3])
    groups = sequence[9:27]
    steps = [0.5 - 0.1 * g for g in groups]
    steps[0], steps[9] = 3.0, 3.5  # epoch starts, left out
    run = {"config": "O1", "steps": steps, "cpu_steps": [2 * s for s in steps]}
    found = bench_groups.per_group(run, 9)
    assert sorted(found) == [0, 1, 2, 3]
    assert found[0][0] == 10 and found[3][0] == 2  # 12 full steps less the two epoch starts; group 3 twice
    for group, (count, wall, cpu) in found.items():
        assert wall == pytest.approx(1000 * (0.5 - 0.1 * group)) and cpu == pytest.approx(2 * wall)
    assert bench_groups.sequence_of("keras") is None and bench_groups.sequence_of("lessbn") is None
