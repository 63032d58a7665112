"""The statistic of scripts/bench_apps.py: what a step time leaves out, and what it keeps."""

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "experiments"))
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


# ---------------------------------------------------------------- the shared runner (keras_boost.app.turns)
def _reporting_command(name, round_index):
    code = ("import json, os; print('noise'); "
            f"print('[0]<stdout>:RESULT ' + json.dumps({{'pid': os.getpid(), 'name': {name!r}, 'round': {round_index}}}))")
    return [sys.executable, "-c", code]


def test_take_turns_runs_each_configuration_in_its_own_process_rotating_the_order():
    from keras_boost.app import turns

    seen = []
    results = turns.take_turns(["a", "b", "c"], 3, _reporting_command, timeout=60,
                               report=lambda name, r, result: seen.append((r, name)))
    assert seen == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert {name: [r["round"] for r in rs] for name, rs in results.items()} == {n: [0, 1, 2] for n in "abc"}
    pids = [r["pid"] for rs in results.values() for r in rs]
    assert len(set(pids)) == 9  # nine processes, none shared


def test_take_turns_fixed_order_when_not_rotating():
    from keras_boost.app import turns

    assert turns.turn_order(["a", "b", "c"], 4, rotate=False) == ["a", "b", "c"]
    assert turns.turn_order(["a", "b", "c"], 4) == ["b", "c", "a"]


@pytest.mark.parametrize("code, reason", [("import sys; print('RESULT {}'); sys.exit(3)", "exit status 3"),
                                          ("print('no result here')", "no result")])
def test_a_failed_run_names_itself_and_why(code, reason):
    from keras_boost.app import turns

    with pytest.raises(turns.RunFailed, match=rf"^O1 \(round 1\) failed \({reason}\)"):
        turns.take_turns(["O1"], 1, lambda name, r: [sys.executable, "-c", code], timeout=60)


def test_rounds_must_be_a_positive_integer():
    from keras_boost.app import turns

    with pytest.raises(ValueError, match="rounds must be a positive integer, got 0"):
        turns.take_turns(["a"], 0, _reporting_command, timeout=60)


def test_spread_and_median_range():
    from keras_boost.app import turns

    assert turns.spread([3.0, None, 1.25], 2) == "1.25-3.00" and turns.spread([None]) == "-"
    assert turns.median_range([1.0, 4.0, 2.0], 1) == "2.0 [1.0-4.0]" and turns.median_range([2.5], 2) == "2.50"
    assert turns.median([None, 3, 1, 2]) == 2 and turns.median([]) is None


def test_every_benchmark_script_imports():
    """Every script under scripts/ and scripts/experiments/ loads (its imports name what exists)."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent / "scripts"
    failures = []
    for path in sorted([*root.glob("bench_*.py"), *(root / "experiments").glob("bench_*.py"), root / "mutation_check.py"]):
        spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - any import failure is the finding
            failures.append(f"{path.relative_to(root.parent)}: {type(error).__name__}: {error}")
    assert not failures, "\n".join(failures)


def test_time_to_accuracy_keeps_the_earlier_runs_of_the_levels_not_run_again_with_the_reference_first():
    import bench_time_to_accuracy

    def runs(level, seeds, tag):
        return [{"level": level, "seed": seed, "tag": tag} for seed in seeds]

    earlier = runs("O0", [0, 1], "old") + runs("O1", [0, 1], "old") + runs("O1:float32", [0, 1], "old")
    new = runs("O1", [0, 1], "new") + runs("O2", [0, 1], "new")
    merged = bench_time_to_accuracy.merge_runs(earlier, new, ["O1", "O2"])
    assert [(r["level"], r["tag"]) for r in merged] == [
        ("O0", "old"), ("O0", "old"), ("O1", "new"), ("O1", "new"), ("O1:float32", "old"), ("O1:float32", "old"),
        ("O2", "new"), ("O2", "new")]
    # a rerun of every level keeps nothing earlier
    assert bench_time_to_accuracy.merge_runs(earlier, new, ["O0", "O1", "O1:float32", "O2"]) == new
