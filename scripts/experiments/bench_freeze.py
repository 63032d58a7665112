"""Gradient freeze: what it costs and saves on this machine (single process, CPU).

1. Step time of each freeze group k of the demo ResNet (28x28x1, batch 128, SGD with
   momentum, G=10 so one kernel block per group) against the full step (group 0). One
   model and one compiled train function: before each timed step the schedule position
   is set to k (the FreezeOpt strategy is 0..9), so every group runs through the same
   `tf.switch_case`. Groups are interleaved in a shuffled order in each round, after a
   warm-up; the table gives medians. The number of kernel gradients
   (Conv2DBackpropFilter) in each branch's traced graph is shown next to it.
2. Epoch time and final test accuracy with the defaults
   (GradientFreeze(param_groups=10, freeze_type=1, freeze_p=0.7, total_steps=steps))
   against no freezing, on a Fashion-MNIST subset with the same seeds; accuracy on the
   full 10k test set. The two runs alternate epoch by epoch on the same shuffled order.

Usage:
    .venv/bin/python scripts/experiments/bench_freeze.py [--train-samples 20000] [--epochs 3]
        [--rounds 15] [--batch 128] [--json out.json]
"""

import argparse
import collections
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_boost import FreezeOpt, GradientFreeze, split_parameters_groups  # noqa: E402
from keras_boost.app.data import load_fashion_mnist  # noqa: E402
from keras_boost.app.demo_net import demo_resnet  # noqa: E402

GROUPS = 10
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def load():
    return tuple(round(v, 2) for v in os.getloadavg())


def optimizer():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def _count_ops(library, name, op_type):
    count = 0
    for node in library[name].node_def:
        count += node.op == op_type
        for attr in node.attr.values():
            for nested in [attr.func.name] if attr.func.name else [f.name for f in attr.list.func]:
                if nested in library:
                    count += _count_ops(library, nested, op_type)
    return count


def _traced_step(function, seen=None):
    """Keras' `one_step_on_data` tf.function, found in the closures of `model.train_function`."""
    seen = set() if seen is None else seen
    if id(function) in seen:
        return None
    seen.add(id(function))
    if hasattr(function, "experimental_get_tracing_count") and getattr(function, "__name__", "") == "one_step_on_data":
        return function
    for cell in getattr(function, "__closure__", None) or ():
        try:
            found = _traced_step(cell.cell_contents, seen)
        except ValueError:  # empty cell
            continue
        if found is not None:
            return found
    return None


def kernel_gradients_per_branch(model, data):
    """Conv2DBackpropFilter ops per branch of the step's switch_case, in the graph Keras traced."""
    step = _traced_step(model.train_function)
    if step is not None:
        concrete = step.get_concrete_function(data)  # the cached trace, no retracing
    else:
        spec = (tf.TensorSpec((None, 28, 28, 1), tf.float32), tf.TensorSpec((None,), tf.int32))
        concrete = tf.function(model.train_step, autograph=False).get_concrete_function(spec)
    graph = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}
    cases = [n for n in graph.node if n.op in ("Case", "StatelessCase")]
    if not cases:  # the Case sits in the function the trace calls
        cases = [n for f in library.values() for n in f.node_def if n.op in ("Case", "StatelessCase")]
    (case,) = cases
    return [_count_ops(library, f.name, "Conv2DBackpropFilter") for f in case.attr["branches"].list.func]


def step_times(batch, rounds, warmup, seed):
    keras.utils.set_random_seed(seed)
    model = demo_resnet()
    opt = optimizer()
    groups = split_parameters_groups(model, GROUPS)
    model.compile(optimizer=opt, loss=LOSS, gradient_freeze=FreezeOpt(opt, groups, list(range(GROUPS))))
    variables = len(model.trainable_variables)
    params = [int(sum(np.prod(v.shape) for v in g)) for g in groups]
    (position,) = [v for v in model.boost_state.variables if v.name == "freeze_position"]
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((batch, 28, 28, 1), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, batch).astype(np.int32))
    model.make_train_function()
    train_function = model.train_function

    def run(k):
        position.assign(k)
        start = time.perf_counter()
        logs = train_function([(x, y)])
        group = int(logs["freeze_group"])  # also waits for the step
        elapsed = time.perf_counter() - start
        assert group == k, (group, k)
        return elapsed

    # the same network and step without gradient_freeze: no switch_case at all
    keras.utils.set_random_seed(seed)
    plain = demo_resnet()
    plain.compile(optimizer=optimizer(), loss=LOSS)
    plain.make_train_function()
    plain_function = plain.train_function

    def run_plain():
        start = time.perf_counter()
        float(plain_function([(x, y)])["loss"])
        return time.perf_counter() - start

    start = time.perf_counter()
    run(0)  # traces every branch once
    trace_s = time.perf_counter() - start
    run_plain()
    for _ in range(warmup):
        run_plain()
        for k in range(GROUPS):
            run(k)
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for k in rng.permutation(GROUPS + 1):
            if k == GROUPS:
                times["plain"].append(run_plain())
            else:
                times[int(k)].append(run(int(k)))
    medians = [float(np.median(times[k])) for k in range(GROUPS)]
    rows = []
    total = params[0]
    for k in range(GROUPS):
        rows.append({"group": k, "variables": len(groups[k]), "params_share": params[k] / total,
                     "median_ms": 1000 * medians[k], "ratio": medians[k] / medians[0],
                     "q25_ms": 1000 * float(np.percentile(times[k], 25)),
                     "q75_ms": 1000 * float(np.percentile(times[k], 75))})
    kernel_grads = kernel_gradients_per_branch(model, (x, y))
    for row, grads in zip(rows, kernel_grads):
        row["kernel_grads"] = grads
    plain_median = float(np.median(times["plain"]))
    plain_row = {"median_ms": 1000 * plain_median, "ratio": plain_median / medians[0],
                 "q25_ms": 1000 * float(np.percentile(times["plain"], 25)),
                 "q75_ms": 1000 * float(np.percentile(times["plain"], 75))}
    return {"rows": rows, "plain": plain_row, "trace_s": trace_s, "variables": variables}


class GroupCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.groups = collections.Counter()

    def on_train_batch_end(self, batch, logs=None):
        if logs and "freeze_group" in logs:
            self.groups[int(logs["freeze_group"])] += 1


def training_runs(configs, train, test, epochs, batch, seed):
    """Trains one model per config, epoch by epoch in alternation, on the same data order.

    Alternating (A B, then B A, ...) spreads the machine's changing load over both runs.
    """
    models, counters, epoch_s = {}, {}, {}
    for name, freeze in configs.items():
        keras.utils.set_random_seed(seed)
        models[name] = demo_resnet()
        models[name].compile(optimizer=optimizer(), loss=LOSS, metrics=["accuracy"], gradient_freeze=freeze)
        counters[name], epoch_s[name] = GroupCounter(), []
    rng = np.random.default_rng(seed + 1)
    names = list(configs)
    for epoch in range(epochs):
        order = rng.permutation(len(train[0]))
        x, y = train[0][order], train[1][order]
        for name in names if epoch % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            models[name].fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[counters[name]])
            epoch_s[name].append(time.perf_counter() - start)
    runs = {}
    for name, model in models.items():
        evaluation = model.evaluate(*test, batch_size=500, verbose=0, return_dict=True)
        runs[name] = {"epoch_s": epoch_s[name], "test_accuracy": float(evaluation["accuracy"]),
                      "test_loss": float(evaluation["loss"]), "groups": dict(sorted(counters[name].groups.items())),
                      "iterations": int(model.optimizer.iterations.numpy())}
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-samples", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()

    report = {"command": " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "tensorflow": tf.__version__, "keras": keras.__version__, "load_start": load()}
    began = time.perf_counter()
    report["step"] = step_times(args.batch, args.rounds, args.warmup, args.seed)
    report["load_after_step"] = load()
    print(f"\n(1) step time per freeze group, demo_resnet, batch {args.batch}, SGD momentum, "
          f"{args.rounds} rounds after {args.warmup} warm-up rounds; load {report['load_start']} -> "
          f"{report['load_after_step']}; tracing 10 branches took {report['step']['trace_s']:.1f} s")
    print("| group k | variables trained | share of parameters | kernel grads in graph | median step | "
          "IQR | vs full |")
    print("|---|---|---|---|---|---|---|")
    for r in report["step"]["rows"]:
        print(f"| {r['group']} | {r['variables']} of {report['step']['variables']} | {r['params_share']:.1%} | "
              f"{r['kernel_grads']} | {r['median_ms']:.1f} ms | {r['q25_ms']:.0f}-{r['q75_ms']:.0f} ms | "
              f"{r['ratio']:.2f}x |")
    r = report["step"]["plain"]
    print(f"| no gradient_freeze (no switch_case) | all | 100.0% | 9 | {r['median_ms']:.1f} ms | "
          f"{r['q25_ms']:.0f}-{r['q75_ms']:.0f} ms | {r['ratio']:.2f}x |")

    if not args.skip_training:
        x, y = load_fashion_mnist("train")
        rng = np.random.default_rng(args.seed)
        keep = rng.permutation(len(x))[:args.train_samples]
        train = (x[keep], y[keep])
        test = load_fashion_mnist("test")
        steps = args.epochs * (-(-len(keep) // args.batch))
        configs = {"no freeze": None,
                   "GradientFreeze defaults": GradientFreeze(param_groups=10, freeze_type=1, freeze_p=0.7,
                                                             total_steps=steps)}
        runs = training_runs(configs, train, test, args.epochs, args.batch, args.seed)
        report["training"] = runs
        report["load_after_training"] = load()
        base = runs["no freeze"]
        print(f"\n(2) Fashion-MNIST, {len(keep)} training samples, {args.epochs} epochs of {steps // args.epochs} "
              f"steps, batch {args.batch}, test on the full {len(test[0])} images")
        print(f"(epochs alternate between the runs; the first epoch includes tracing; load after "
              f"{report['load_after_training']})")
        print("| run | epoch times | mean of epochs 2.. | vs no freeze | test accuracy | test loss | "
              "steps per group |")
        print("|---|---|---|---|---|---|---|")
        for name, run in runs.items():
            later = np.mean(run["epoch_s"][1:] or run["epoch_s"])
            base_later = np.mean(base["epoch_s"][1:] or base["epoch_s"])
            print(f"| {name} | {', '.join(f'{t:.1f}' for t in run['epoch_s'])} s | {later:.1f} s | "
                  f"{later / base_later:.2f}x | {run['test_accuracy']:.4f} | {run['test_loss']:.4f} | "
                  f"{run['groups'] or '-'} |")
    report["total_s"] = time.perf_counter() - began
    report["load_end"] = load()
    print(f"\ntotal {report['total_s']:.0f} s; load average at the end {report['load_end']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
