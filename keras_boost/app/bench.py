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
    """Per epoch: training time (evaluation excluded), training loss, test accuracy; step times after the first epoch; first step."""

    def __init__(self, test_data):
        super().__init__()
        self.test_data = test_data
        self.train_times, self.accuracies, self.step_times, self.losses = [], [], [], []
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
        self.losses.append(float((logs or {}).get("loss", float("nan"))))
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self._steps_in_epoch
        x, y = self.test_data
        self.accuracies.append(float(self.model.evaluate(x, y, batch_size=500, verbose=0, return_dict=True)["accuracy"]))


LEVELS = ("O0", "O1", "O2")


def parse_level(text):
    """A `--levels` entry: a level, or a level and the precision it runs in (`O1:float32`); returns (level, precision or None)."""
    from keras_boost.precision import POLICIES

    level, _, precision = text.partition(":")
    if level not in LEVELS or (precision and precision not in POLICIES) or text.endswith(":"):
        raise ValueError(f"a level is one of {LEVELS}, optionally with a precision after a colon ({', '.join(POLICIES)}), "
                         f"as in O1:float32; got {text!r}")
    return level, precision or None


def run_level(args, level):
    """One run of `level` (a `--levels` entry) in this process (on this worker); returns its times and accuracies."""
    from keras_boost.app.training import boost_report, prepare, report_callbacks

    level_args = copy.copy(args)
    level_args.level, precision = parse_level(level)
    level_args.precision = precision or args.precision
    model, (x, y), test = prepare(level_args)
    clock = _EpochClock(test)
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
              shuffle=True, verbose=0, callbacks=[clock, *report_callbacks(model)])
    return {"level": level, "model": args.model, "seed": args.seed, "epoch_times": clock.train_times,
            "accuracies": clock.accuracies, "losses": clock.losses, "steps_per_epoch": clock.steps_per_epoch, "first_step": clock.first_step, "step_time": steady_step(clock.step_times, clock.steps_per_epoch),
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
    """Training seconds until the end of the first epoch whose test accuracy reached `target`; None if none did."""
    reached = epochs_to(result, target)
    return None if reached is None else sum(result["epoch_times"][:reached])


def epochs_to(result, target):
    """Epochs until the test accuracy first reached `target` (1 = after the first); None if it never did."""
    for epoch, accuracy in enumerate(result["accuracies"], 1):
        if accuracy >= target:
            return epoch
    return None


NEAR = 0.005  # the second target: the first level's mean final accuracy less 0.5 pp


def mean_curve_time(runs, target):
    """Training seconds until the mean accuracy curve of `runs` first reaches `target`.

    The curve is, epoch by epoch, the mean over the runs of the test accuracy and of the
    training time so far; so the first level reaches its own mean final accuracy by its
    last epoch at the latest, and a level is compared on the same footing (each run
    alone reaches the mean in only some of them). Accuracies within 1e-6 count as equal
    (float32 metrics: two levels with the same mean may differ in the last bits). None if
    the curve never reaches it.
    """
    epochs = min(len(r["accuracies"]) for r in runs)
    elapsed = 0.0
    for epoch in range(epochs):
        elapsed += statistics.fmean(r["epoch_times"][epoch] for r in runs)
        if statistics.fmean(r["accuracies"][epoch] for r in runs) >= target - 1e-6:
            return elapsed, epoch + 1
    return None, None


def summarize(runs, levels):
    """Per level: medians and ranges over its runs (every round and seed).

    The target is the first level's final test accuracy, the mean over its runs (MLPerf's
    and Composer's time to accuracy, with the reference's own result as the bar). A level's
    time to it is `mean_curve_time`: training time (evaluation excluded) to the end of the
    first epoch where its runs' mean accuracy reached it; each run's own time is kept too
    (`to_target_runs`, None where that run never reached it). Also the time to the target
    less 0.5 pp (`NEAR`).
    """
    by_level = {level: [r for r in runs if r["level"] == level] for level in levels}
    final = {level: statistics.mean(r["accuracies"][-1] for r in rs) for level, rs in by_level.items()}
    target = final[levels[0]]
    rows = []
    for level, rs in by_level.items():
        later_epochs = [turns.median(r["epoch_times"][1:]) or r["epoch_times"][0] for r in rs]
        reached = [time_to(r, target) for r in rs]
        near = [time_to(r, target - NEAR) for r in rs]
        to_target, epochs_to_target = mean_curve_time(rs, target)
        steps_per_epoch = turns.median([r["steps_per_epoch"] for r in rs if r.get("steps_per_epoch")])
        rows.append({
            "level": level, "runs": len(rs),
            "epoch": turns.median(later_epochs), "epochs": later_epochs,
            "step": turns.median([r["step_time"] for r in rs if r["step_time"] is not None]),
            "first_step": turns.median([r["first_step"] for r in rs]), "first_epoch": turns.median([r["epoch_times"][0] for r in rs]),
            "to_target": to_target, "to_target_runs": reached, "reached": sum(t is not None for t in reached),
            "steps_to_target": epochs_to_target * steps_per_epoch if epochs_to_target and steps_per_epoch else None,
            "to_near": mean_curve_time(rs, target - NEAR)[0], "to_near_runs": near,
            "near_reached": sum(t is not None for t in near),
            "accuracy": final[level], "accuracies": [r["accuracies"][-1] for r in rs],
            "report": rs[-1]["report"],
        })
    return target, rows


def _reach(seconds, per_run, base_seconds):
    """'seconds (each run's range, k of n runs reached)' and the speed-up against the base level."""
    if seconds is None:
        return "not reached", "-"
    reached = [t for t in per_run if t is not None]
    runs = f" ({turns.spread(reached)}" if reached else " (none alone"
    runs += f"; {len(reached)} of {len(per_run)} runs)" if len(reached) < len(per_run) else ")"
    return f"{seconds:.1f}{runs}", (f"{base_seconds / seconds:.2f}x" if base_seconds else "-")


def markdown_table(runs, levels, target=None):
    computed_target, rows = summarize(runs, levels)
    target = computed_target if target is None else target
    base = rows[0]
    lines = [f"Target test accuracy: {target:.4f} ({base['level']}'s mean final accuracy over its runs); "
             f"the second target {target - NEAR:.4f} is 0.5 pp below. Medians over {base['runs']} run(s) per level, "
             "each in its own process, levels taking turns; ranges in brackets. A time to a target is the training "
             "time (evaluation excluded) to the first epoch where the level's mean accuracy over its runs reached it; "
             "in brackets, the range of the runs' own times, and how many reached it alone.", "",
             f"| level | epoch after the first (s) | step (ms) | per-step speed-up vs {base['level']} | first epoch (s) | "
             f"time to target (s) | steps to target | speed-up to target | time to target - 0.5 pp (s) | "
             f"speed-up | final test accuracy | boost report |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        step_speedup = f"{base['step'] / row['step']:.2f}x" if row["step"] and base["step"] else "-"
        to_target, speedup = _reach(row["to_target"], row["to_target_runs"], base["to_target"])
        to_near, near_speedup = _reach(row["to_near"], row["to_near_runs"], base["to_near"])
        steps = f"{row['steps_to_target']:.0f}" if row["steps_to_target"] else "-"
        report = ", ".join(f"{k}={v}" for k, v in row["report"].items() if k != "level")
        step = f"{1000 * row['step']:.0f}" if row["step"] else "-"
        lines.append(
            f"| {row['level']} | {row['epoch']:.1f} ({turns.spread(row['epochs'])}) | {step} | {step_speedup} | "
            f"{row['first_epoch']:.1f} | {to_target} | {steps} | {speedup} | {to_near} | {near_speedup} | "
            f"{row['accuracy']:.4f} ({turns.spread(row['accuracies'], 4)}) | {report} |")
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
    target, _ = summarize(runs, levels)
    axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target: {levels[0]}'s mean final accuracy")
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
