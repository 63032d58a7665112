"""Epochs and wall time to a target test accuracy: AdaSum against gradient averaging.

Run under a launcher, e.g.
    OMPI_MCA_mpi_yield_when_idle=1 horovodrun -np 4 -H localhost:4 --mpi \\
        .venv/bin/python scripts/bench_adasum_convergence.py --runs avg:0.1 avg:0.2 adasum:0.1

Every run trains the demo model (keras_boost.app.demo_net.demo_resnet, SGD with momentum 0.9)
from the same initial weights on the same shards of Fashion-MNIST, one run after the
other in this one launch, so that all of them see the same machine. `avg:LR` is a
BoostModel without boost stages (gradients averaged across all workers: one large batch
of `workers x batch-size`); `adasum:LR` adds `AdaSum(device_number=1)` (every worker a
group: a local step on its own batch, weight deltas combined by AdaSum). After every
epoch the model is evaluated on the whole 10k test set (sharded, averaged). Rank 0
prints a markdown table and writes every number to `--json`.
"""

import argparse
import json
import time

import bench_common  # noqa: F401  (puts the repository on sys.path)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_boost import AdaSum, BoostModel, distributed  # noqa: E402
from keras_boost.app import data  # noqa: E402
from keras_boost.app.cli import positive_float  # noqa: E402  (the CLI's check of a learning rate)
from keras_boost.app.training import build_model, load_dataset  # noqa: E402

KINDS = ("avg", "adasum")


def parse_run(text):
    """'avg:0.1' -> ('avg', 0.1); the learning rate must be a positive float."""
    kind, _, rate = text.partition(":")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"run kind must be one of {KINDS}, got {kind!r} in {text!r}")
    return kind, positive_float(rate)


class EpochEval(keras.callbacks.Callback):
    """Training time of every epoch (evaluation excluded) and test accuracy after it."""

    def __init__(self, test):
        super().__init__()
        self.test = test
        self.times, self.accuracies, self.losses = [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(float(logs["loss"]))
        x, y = self.test
        result = self.model.evaluate(x, y, batch_size=500, verbose=0, return_dict=True)
        self.accuracies.append(float(result["accuracy"]))


def train_one(kind, lr, train, test, args):
    base = build_model("demo", args.seed)  # same initial weights for every run
    model = BoostModel(base.inputs, base.outputs, name=f"{kind}_{lr}")
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"],
                  adasum=AdaSum(device_number=1) if kind == "adasum" else None)
    clock = EpochEval(test)
    keras.utils.set_random_seed(args.seed)  # same shuffling for every run
    model.fit(*train, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0,
              callbacks=[clock])
    backend = model.boost_step.stage("adasum").combine_backend if model.boost_step.stage("adasum") is not None else None
    return {"run": f"{kind}:{lr}", "kind": kind, "lr": lr, "epoch_times": clock.times,
            "accuracies": clock.accuracies, "train_losses": clock.losses, "combine": backend}


def reached(result, target):
    """(epochs, training seconds) until the test accuracy first reaches `target`, or None."""
    elapsed = 0.0
    for epoch, (seconds, accuracy) in enumerate(zip(result["epoch_times"], result["accuracies"]), 1):
        elapsed += seconds
        if accuracy >= target:
            return epoch, elapsed
    return None


def table(results, target):
    lines = [f"Target test accuracy: {target:.3f}.", "",
             "| run | combine | s/epoch (median) | test accuracy after each epoch | epochs to target | "
             "time to target (s) |", "|---|---|---|---|---|---|"]
    for r in results:
        hit = reached(r, target)
        median = float(np.median(r["epoch_times"]))
        accs = " ".join(f"{a:.4f}" for a in r["accuracies"])
        combine = r["combine"] or "average (allreduce)"
        epochs, seconds = (str(hit[0]), f"{hit[1]:.0f}") if hit else ("not reached", "—")
        lines.append(f"| {r['run']} | {combine} | {median:.1f} | {accs} | {epochs} | {seconds} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", type=parse_run, required=True,
                        help="KIND:LR with KIND in avg, adasum (e.g. avg:0.1 adasum:0.05)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128, help="per-worker batch size")
    parser.add_argument("--train-samples", type=int, default=None, help="first N training images")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every number here (rank 0)")
    args = parser.parse_args()
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    (x, y), (x_test, y_test) = load_dataset("fashion_mnist", args.train_samples, args.seed)
    order = np.random.default_rng(args.seed).permutation(len(x))
    train = data.shard((x[order], y[order]), rank, size)
    test = data.shard((x_test, y_test), rank, size)
    results = []
    for kind, lr in args.runs:
        results.append(train_one(kind, lr, train, test, args))
        if rank == 0:
            print(f"{results[-1]['run']}: accuracies {results[-1]['accuracies']}, "
                  f"epoch times {[round(t, 1) for t in results[-1]['epoch_times']]}", flush=True)
    if rank == 0:
        print(f"{size} workers x batch {args.batch_size} = {size * args.batch_size} per update, "
              f"{len(train[0]) // args.batch_size} updates per epoch")
        print(table(results, args.target))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"workers": size, "batch_size": args.batch_size, "epochs": args.epochs,
                           "train_samples": len(x), "target": args.target, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
