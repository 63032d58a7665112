"""`keras-boost bench`: the same model and data at several boost levels, side by side.

The method holds still on a noisy machine (`keras_boost.app.turns`, shared with the
scripts): every (round, seed, level) run is its own process (a fresh TensorFlow; under
`horovodrun` when `--np` > 1), the levels take turns within each round, their order
rotated by one per round, and `fit` is called as users call it. The table gives medians with
their range over the runs; the plot, test accuracy against training time.
"""

import copy
import json
import os
import statistics
import sys
import tempfile
import time

import keras

from keras_boost import distributed
from keras_boost.app import turns


class _EpochClock(keras.callbacks.Callback):
    """Per epoch: training time (evaluation excluded), test accuracy; step times after the first epoch; first step."""

    def __init__(self, test_data):
        super().__init__()
        self.test_data = test_data
        self.train_times, self.accuracies, self.step_times = [], [], []
        self.first_step, self.steps_per_epoch, self._steps_in_epoch = None, None, 0

    def on_train_begin(self, logs=None):
        self._train_start = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._step_start = time.perf_counter()
        self._steps_in_epoch = 0

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self._steps_in_epoch += 1
        if self.first_step is None:
            self.first_step = now - self._train_start
        elif len(self.train_times) > 0:  # steps after the first epoch (tracing excluded)
            self.step_times.append(now - self._step_start)
        self._step_start = now

    def on_epoch_end(self, epoch, logs=None):
        self.train_times.append(time.perf_counter() - self._start)
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self._steps_in_epoch
        x, y = self.test_data
        self.accuracies.append(float(self.model.evaluate(x, y, batch_size=500, verbose=0, return_dict=True)["accuracy"]))


def run_level(args, level):
    """One run of `level` in this process (on this worker); returns its times and accuracies."""
    from keras_boost.app.training import boost_report, prepare, report_callbacks

    level_args = copy.copy(args)
    level_args.level = level
    model, (x, y), test = prepare(level_args)
    clock = _EpochClock(test)
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
              shuffle=True, verbose=0, callbacks=[clock, *report_callbacks(model)])
    return {"level": level, "seed": args.seed, "epoch_times": clock.train_times, "accuracies": clock.accuracies,
            "first_step": clock.first_step, "step_time": steady_step(clock.step_times, clock.steps_per_epoch),
            "report": boost_report(model)}


def steady_step(steps, steps_per_epoch):
    """Mean step time after the first epoch, without each epoch's first step and tracing steps.

    `steps`: the step times after the first epoch, epoch after epoch. Each epoch's first
    step also times the start of the epoch (it lasted seconds on the benchmark machine for
    every configuration, plain keras.Model included), and a freeze group traced when it
    first trains makes one step last seconds (over 4x the median step); both are left out
    here and counted in the epoch and whole-fit times. A mean, not a median: a freeze level mixes full and partial
    steps, and the median would pick the full step's time. None when there is no such step.
    """
    kept = steady_indices(steps, steps_per_epoch)
    return statistics.fmean(steps[i] for i in kept) if kept else None


def steady_indices(steps, steps_per_epoch):
    """The indices of the steps `steady_step` averages (also how scripts/experiments/bench_groups.py picks them)."""
    inner = [index for index in range(len(steps)) if index % steps_per_epoch]
    if not inner:
        return []
    limit = 4 * statistics.median(steps[i] for i in inner)
    return [i for i in inner if steps[i] <= limit]


def time_to(result, target):
    elapsed = 0.0
    for seconds, accuracy in zip(result["epoch_times"], result["accuracies"]):
        elapsed += seconds
        if accuracy >= target:
            return elapsed
    return None


def summarize(runs, levels):
    """Per level: medians and ranges over its runs (every round and seed)."""
    by_level = {level: [r for r in runs if r["level"] == level] for level in levels}
    final = {level: statistics.mean(r["accuracies"][-1] for r in rs) for level, rs in by_level.items()}
    target = final[levels[0]] - 0.005
    rows = []
    for level, rs in by_level.items():
        later_epochs = [turns.median(r["epoch_times"][1:]) or r["epoch_times"][0] for r in rs]
        reached = [time_to(r, target) for r in rs]
        rows.append({
            "level": level, "runs": len(rs),
            "epoch": turns.median(later_epochs), "epochs": later_epochs,
            "step": turns.median([r["step_time"] for r in rs if r["step_time"] is not None]),
            "first_step": turns.median([r["first_step"] for r in rs]), "first_epoch": turns.median([r["epoch_times"][0] for r in rs]),
            "to_target": turns.median([t for t in reached if t is not None]) if all(t is not None for t in reached) else None,
            "reached": sum(t is not None for t in reached),
            "accuracy": final[level], "accuracies": [r["accuracies"][-1] for r in rs],
            "report": rs[-1]["report"],
        })
    return target, rows


def markdown_table(runs, levels, target=None):
    computed_target, rows = summarize(runs, levels)
    target = computed_target if target is None else target
    base = rows[0]
    lines = [f"Target test accuracy: {target:.4f} ({base['level']}'s mean final accuracy - 0.5 pp). Medians over "
             f"{base['runs']} run(s) per level, each in its own process, levels taking turns; ranges in brackets.", "",
             f"| level | epoch after the first (s) | step (ms) | per-step speed-up vs {base['level']} | first step (s) | "
             f"first epoch (s) | time to target (s) | speed-up to target | final test accuracy | boost report |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        step_speedup = f"{base['step'] / row['step']:.2f}x" if row["step"] and base["step"] else "-"
        if row["to_target"] and base["to_target"]:
            to_target, speedup = f"{row['to_target']:.1f}", f"{base['to_target'] / row['to_target']:.2f}x"
        else:
            to_target = speedup = f"not reached in {row['runs'] - row['reached']} of {row['runs']} runs"
        report = ", ".join(f"{k}={v}" for k, v in row["report"].items() if k != "level")
        step = f"{1000 * row['step']:.0f}" if row["step"] else "-"
        lines.append(
            f"| {row['level']} | {row['epoch']:.1f} ({turns.spread(row['epochs'])}) | {step} | {step_speedup} | "
            f"{row['first_step']:.1f} | {row['first_epoch']:.1f} | {to_target} | {speedup} | {row['accuracy']:.4f} "
            f"({turns.spread(row['accuracies'], 4)}) | {report} |")
    return "\n".join(lines)


def plot(runs, levels, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    colors = {}
    for r in runs:
        elapsed, t = [], 0.0
        for seconds in r["epoch_times"]:
            t += seconds
            elapsed.append(t)
        label = None if r["level"] in colors else r["level"]
        line = axes.plot(elapsed, r["accuracies"], marker="o", label=label, color=colors.get(r["level"]), alpha=0.8)
        colors.setdefault(r["level"], line[0].get_color())
    axes.set_xlabel("training wall time (s)")
    axes.set_ylabel("test accuracy")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def child_command(argv, level, seed, result_path, np_workers, controller):
    """The command line of one run: this bench, one level and seed, writing its result to `result_path`."""
    from keras_boost.app.launch import LAUNCH_OPTIONS, horovodrun_command, launch_target, without_options

    # the launch options stay here: the run's workers get the command without them (a
    # hostfile need not exist on the other hosts)
    own = [sys.executable, "-m", "keras_boost.app.cli",
           *without_options(argv, (*LAUNCH_OPTIONS, "--levels", "--seeds", "--seed", "--rounds", "--table", "--plot")),
           "--levels", level, "--seed", str(seed), "--result-json", result_path]
    return horovodrun_command(np_workers, controller, own[1:]) if np_workers > 1 or launch_target()["hosts"] else own


def run_bench(args, argv):
    """Every round, seed and level in its own process, taking turns (`keras_boost.app.turns`); writes the table and the plot."""
    seeds = args.seeds or [args.seed]
    runs = []
    if args.raw:
        open(args.raw, "w").close()  # this bench's runs only
    with tempfile.TemporaryDirectory(prefix="keras-boost-bench-") as folder:
        def path_of(name, round_index):
            seed, level = name
            return os.path.join(folder, f"{round_index}-{seed}-{level}.json")

        def command(name, round_index):
            seed, level = name
            return child_command(argv, level, seed, path_of(name, round_index), args.np, args.controller)

        def read(done):
            path = done.args[done.args.index("--result-json") + 1] if "--result-json" in done.args else None
            if path is None or not os.path.exists(path):
                return None
            with open(path) as handle:
                return json.load(handle)

        def report(name, round_index, run):
            runs.append(run)
            print(f"round {round_index + 1} seed {name[0]} {name[1]}: epochs "
                  f"{[round(t, 1) for t in run['epoch_times']]} s, test accuracy "
                  f"{[round(a, 4) for a in run['accuracies']]}", flush=True)
            if args.raw:
                with open(args.raw, "a") as handle:
                    handle.write(json.dumps({"round": round_index, **run}) + "\n")

        turns.take_turns([(seed, level) for seed in seeds for level in args.levels], args.rounds, command,
                         timeout=args.run_timeout, read=read, report=report)
    table = markdown_table(runs, args.levels)
    with open(args.table, "w") as handle:
        handle.write(table + "\n")
    plot(runs, args.levels, args.plot)
    return table


def run_child(args):
    """A child run: one level on this worker; rank 0 writes the result file."""
    result = run_level(args, args.levels[0])
    if distributed.rank() == 0:
        with open(args.result_json, "w") as handle:
            json.dump(result, handle)
