"""`keras-boost bench`: the same model and data at several boost levels, side by side."""

import copy
import time

import keras

from keras_boost import distributed
from keras_boost.app.training import boost_report, prepare


class _EpochClock(keras.callbacks.Callback):
    """Training time per epoch (evaluation excluded) and test accuracy after each epoch."""

    def __init__(self, test_data):
        super().__init__()
        self.test_data = test_data
        self.train_times, self.accuracies = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.train_times.append(time.perf_counter() - self._start)
        x, y = self.test_data
        self.accuracies.append(float(self.model.evaluate(x, y, batch_size=500, verbose=0, return_dict=True)["accuracy"]))


def run_level(args, level):
    level_args = copy.copy(args)
    level_args.level = level
    model, (x, y), test = prepare(level_args)
    clock = _EpochClock(test)
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
              shuffle=True, verbose=0, callbacks=[clock])
    return {"level": level, "epoch_times": clock.train_times, "accuracies": clock.accuracies,
            "report": boost_report(model)}


def time_to(result, target):
    elapsed = 0.0
    for seconds, accuracy in zip(result["epoch_times"], result["accuracies"]):
        elapsed += seconds
        if accuracy >= target:
            return elapsed
    return None


def markdown_table(results, target):
    base = results[0]
    base_time = time_to(base, target)
    lines = [f"Target test accuracy: {target:.4f} ({base['level']}'s final accuracy - 0.5 pp).", "",
             "| level | median epoch time (s) | time to target (s) | final test accuracy | speed-up to target "
             f"vs {base['level']} | epoch speed-up | boost report |",
             "|---|---|---|---|---|---|---|"]
    base_epoch = sorted(base["epoch_times"])[len(base["epoch_times"]) // 2]
    for r in results:
        epoch = sorted(r["epoch_times"])[len(r["epoch_times"]) // 2]
        reached = time_to(r, target)
        speedup = f"{base_time / reached:.2f}x" if reached and base_time else "not reached"
        report = ", ".join(f"{k}={v}" for k, v in r["report"].items() if k != "level")
        lines.append(f"| {r['level']} | {epoch:.1f} | {'%.1f' % reached if reached else 'not reached'} | "
                     f"{r['accuracies'][-1]:.4f} | {speedup} | {base_epoch / epoch:.2f}x | {report} |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for r in results:
        elapsed, t = [], 0.0
        for seconds in r["epoch_times"]:
            t += seconds
            elapsed.append(t)
        axes.plot(elapsed, r["accuracies"], marker="o", label=r["level"])
    axes.set_xlabel("training wall time (s)")
    axes.set_ylabel("test accuracy")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run_bench(args):
    """Runs every level in turn on this worker; rank 0 writes the table and the plot."""
    results = [run_level(args, level) for level in args.levels]
    target = results[0]["accuracies"][-1] - 0.005
    table = markdown_table(results, target)
    if distributed.rank() == 0:
        with open(args.table, "w") as handle:
            handle.write(table + "\n")
        plot(results, args.plot)
    return table
