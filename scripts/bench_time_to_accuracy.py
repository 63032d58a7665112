"""Time to accuracy, model by model: `keras-boost bench` over each model's recipe, with several seeds.

For each model (keras_boost/app/recipes.py) this runs

    keras-boost bench --model M --levels O0 O1 O1:float32 --seeds 0 1 2 --epochs E --train-samples N ...

(one process per run, the levels taking turns, seed after seed) and keeps its table, its plot
and every run's raw data (epoch times, test accuracy after each epoch, the boost report) in
--out: M.md, M.png, M.jsonl. The levels of M.jsonl that a run does not run again keep their
earlier runs (`--levels O2` adds O2 beside the O0 and O1 already there). The target is O0's final test accuracy, the mean over its seeds;
a level's time to it is the training time to the end of the epoch where the mean of its seeds'
accuracy curves first reached it. Then it writes summary.md (per model and level: the time to
O0's accuracy against O0's, the runs that reached it alone, the final accuracy, mean and range
over the seeds) and levels.md (the tables of docs/auto_boost.md and docs/benchmarks.md).

    python scripts/bench_time_to_accuracy.py --out docs/time_to_accuracy
    python scripts/bench_time_to_accuracy.py --models demo --np 2 --levels O0 O1 O2 --out docs/time_to_accuracy
    python scripts/bench_time_to_accuracy.py --models demo --np 2 --levels O2 --config dn1.json --suffix adasum
    python scripts/bench_time_to_accuracy.py --summary-only --out docs/time_to_accuracy
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import bench_common  # noqa: F401  (sys.path and log level)

from keras_boost.app import bench

# model: training samples, epochs, test samples, and where the run sets them: the batch size (default:
# the recipe's) and the levels (default: --levels). The keras.applications ResNet50 and the small
# Xception have many BatchNorms, whose moving statistics (momentum 0.99) leave O0 at chance on the test
# set for hundreds of steps: their budgets give them enough steps, and their runs compare O0 and O1 only.
BUDGETS = {
    "demo": dict(samples=10000, epochs=6, test=5000),
    "mnist_convnet": dict(samples=10000, epochs=8, test=5000),
    "timeseries": dict(samples=10000, epochs=6, test=5000),
    "transformer": dict(samples=6000, epochs=6, test=5000),
    "xception": dict(samples=8000, epochs=4, test=2000, batch=32, levels=["O0", "O1"]),
    "resnet50": dict(samples=4000, epochs=5, test=2000, batch=32, levels=["O0", "O1"]),
}


# the order of the models in levels.md (the tables of docs/auto_boost.md and docs/benchmarks.md)
TABLE_ORDER = ("demo", "resnet50", "xception", "mnist_convnet", "timeseries", "transformer", "demo-2w",
               "demo-2w-adasum")


def run_model(model, args):
    budget = BUDGETS[model]
    samples, epochs, test_samples = budget["samples"], budget["epochs"], budget["test"]
    levels = args.levels or budget.get("levels", ["O0", "O1", "O1:float32"])
    name = (f"{model}-{args.np}w" if args.np > 1 else model) + (f"-{args.suffix}" if args.suffix else "")
    paths = {kind: os.path.join(args.out, f"{name}.{kind}") for kind in ("md", "png", "jsonl")}
    command = [sys.executable, "-m", "keras_boost.app.cli", "bench", "--model", model, "--levels", *levels,
               "--seeds", *map(str, args.seeds), "--epochs", str(args.epochs or epochs),
               "--train-samples", str(samples), "--test-samples", str(test_samples),
               "--table", paths["md"], "--plot", paths["png"], "--raw", paths["jsonl"],
               "--run-timeout", str(args.run_timeout)]
    if "batch" in budget:
        command += ["--batch-size", str(budget["batch"])]
    if args.np > 1:
        command += ["--np", str(args.np)]
    if args.config:
        command += ["--config", args.config]
    earlier = _read_runs(paths["jsonl"]) if os.path.exists(paths["jsonl"]) else []
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)
    kept = sorted(set(run["level"] for run in earlier) - set(levels))
    if kept:
        print(f"{name}: keeping the earlier runs of {kept}", flush=True)
        runs = merge_runs(earlier, _read_runs(paths["jsonl"]), levels)
        with open(paths["jsonl"], "w") as handle:
            handle.writelines(json.dumps(run) + "\n" for run in runs)


def merge_runs(earlier, new, levels):
    """The `new` runs of `levels`, and the `earlier` runs of the levels not run again, ordered by
    level as the earlier runs were (so their reference stays first), new levels after them."""
    order = list(dict.fromkeys([run["level"] for run in earlier] + list(levels)))
    kept = [run for run in earlier if run["level"] not in levels]
    return sorted(kept + new, key=lambda run: order.index(run["level"]))


def _read_runs(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def summary_rows(raw_path):
    runs = _read_runs(raw_path)
    levels = list(dict.fromkeys(r["level"] for r in runs))
    target, rows = bench.summarize(runs, levels)
    return runs, target, rows


def summary(out):
    """summary.md from every model's raw runs; each model's table and plot written again from them."""
    lines = ["| model | level | runs | epoch after the first (s) | time to O0's accuracy (s) | speed-up | "
             "runs that reached it alone | time to O0's - 0.5 pp: speed-up | final test accuracy, mean (range) | "
             "vs O0 (pp) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in sorted(f[:-6] for f in os.listdir(out) if f.endswith(".jsonl")):
        runs, target, rows = summary_rows(os.path.join(out, f"{name}.jsonl"))
        levels = [row["level"] for row in rows]
        with open(os.path.join(out, f"{name}.md"), "w") as handle:
            handle.write(bench.markdown_table(runs, levels) + "\n")
        bench.plot(runs, levels, os.path.join(out, f"{name}.png"))
        base = rows[0]
        for row in rows:
            to_target = f"{row['to_target']:.1f}" if row["to_target"] else "not reached"
            speedup = f"{base['to_target'] / row['to_target']:.2f}x" if row["to_target"] and base["to_target"] else "-"
            near = f"{base['to_near'] / row['to_near']:.2f}x" if row["to_near"] and base["to_near"] else "-"
            finals = row["accuracies"]
            lines.append(f"| {name} | {row['level']} | {row['runs']} | {row['epoch']:.2f} | {to_target} | {speedup} | "
                         f"{row['reached']} of {row['runs']} | {near} | {100 * statistics.mean(finals):.2f}% "
                         f"({100 * min(finals):.2f}-{100 * max(finals):.2f}) | "
                         f"{100 * (row['accuracy'] - base['accuracy']):+.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as handle:
        handle.write(text)
    return text


def level_tables(out):
    """The two tables of docs/auto_boost.md and docs/benchmarks.md ("Mixed precision on CPUs") from the raw runs:
    each level against O0 per model, and O1 in mixed_bfloat16 against O1 in float32."""
    levels_lines = ["| model | runs | O0 final accuracy, mean (range) | level | final accuracy (vs O0) | "
                    "time to O0's accuracy | to 0.5 pp below | per epoch |", "|---|---|---|---|---|---|---|---|"]
    precision_lines = ["| model | O1 (mixed_bfloat16): epoch after the first | to O0's accuracy | final | "
                       "O1 in float32: epoch | to O0's accuracy | final |", "|---|---|---|---|---|---|---|"]

    def spread(finals):
        return f"{100 * statistics.mean(finals):.2f}% ({100 * min(finals):.2f}–{100 * max(finals):.2f})"

    def ratio(base, row, key):
        return f"{base[key] / row[key]:.2f}×" if row[key] and base[key] else "not reached"

    for name in TABLE_ORDER:
        path = os.path.join(out, f"{name}.jsonl")
        if not os.path.exists(path):
            continue
        _, _, rows = summary_rows(path)
        base = rows[0]
        for row in rows[1:]:
            to_target = ratio(base, row, "to_target")
            levels_lines.append(
                f"| {name} | {row['runs']} | {spread(base['accuracies'])} | {row['level']} | "
                f"{spread(row['accuracies'])}, {100 * (row['accuracy'] - base['accuracy']):+.2f} pp | "
                f"{'**' + to_target + '**' if row['to_target'] and base['to_target'] else to_target} | "
                f"{ratio(base, row, 'to_near')} | {base['epoch'] / row['epoch']:.2f}× |")
        by_level = {row["level"]: row for row in rows}
        if "O1" in by_level and "O1:float32" in by_level:
            cells = [f"{by_level[lv]['epoch']:.2f} s | {ratio(base, by_level[lv], 'to_target')} | "
                     f"{100 * by_level[lv]['accuracy']:.2f}%" for lv in ("O1", "O1:float32")]
            precision_lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(levels_lines) + "\n\n" + "\n".join(precision_lines) + "\n"
    with open(os.path.join(out, "levels.md"), "w") as handle:
        handle.write(text)
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(BUDGETS), default=list(BUDGETS))
    parser.add_argument("--levels", nargs="+", default=None, help="default: O0 O1 O1:float32, or the model's own")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="every model's epochs (default: its budget)")
    parser.add_argument("--np", type=int, default=1)
    parser.add_argument("--run-timeout", type=int, default=1800)
    parser.add_argument("--config", default=None, help="a boost configuration (JSON file) for every run")
    parser.add_argument("--suffix", default=None, help="added to the files' names (demo-2w-SUFFIX.jsonl), "
                        "for a run with --config beside the plain one")
    parser.add_argument("--out", default="docs/time_to_accuracy")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not args.summary_only:
        for model in args.models:
            run_model(model, args)
    print(summary(args.out))
    print(level_tables(args.out))


if __name__ == "__main__":
    main()
