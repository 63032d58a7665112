"""LessBN benchmark: step time with and without LessBN, and accuracy with LessBN + FN + GC.

    .venv/bin/python scripts/experiments/bench_less_bn.py --rounds 4 --train-samples 20000 --epochs 3

Step times: the demo model (batch 128, 28x28x1) and keras.applications ResNet50 (batch 32,
32x32x3), each against its LessBN rewrite, configurations taking turns for `--rounds`
rounds in one process (medians after the first steps of each round). Accuracy: the demo
model unmodified against LessBN + FN head + gradient centralization, same seed, data and
epochs, on the full Fashion-MNIST test set.
"""

import sys
import argparse
import os
import statistics
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
from bench_common import StepTimer

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_boost import BoostModel, LessBN  # noqa: E402
from keras_boost.app import data  # noqa: E402
from keras_boost.app.demo_net import demo_resnet  # noqa: E402


def compiled(model, **boost):
    boosted = BoostModel(model.inputs, model.outputs)
    boosted.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"], **boost)
    return boosted


def step_times(args):
    keras.utils.set_random_seed(0)
    demo = demo_resnet(model_class=keras.Model)
    resnet = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None)
    cases = {
        "demo": (demo, LessBN(demo, fn_flag=True), (28, 28, 1), 128),
        "ResNet50 32x32": (resnet, LessBN(resnet, fn_flag=True), (32, 32, 3), 32),
    }
    rows = []
    for name, (full, less, shape, batch) in cases.items():
        rng = np.random.default_rng(0)
        x = rng.random((batch * args.steps, *shape), dtype=np.float32)
        y = rng.integers(0, 10, len(x))
        models = {"full": compiled(full), "LessBN": compiled(less)}
        times = {k: [] for k in models}
        for _ in range(args.rounds):
            for key, model in models.items():
                timer = StepTimer()
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[timer], shuffle=False)
                times[key].extend(timer.times[2:])
        full_ms, less_ms = (1000 * statistics.median(times[k]) for k in ("full", "LessBN"))
        removed = less.less_bn_report
        rows.append(f"| {name} | {removed.num_removed} of {removed.num_removed + removed.num_kept} | "
                    f"{full_ms:.1f} | {less_ms:.1f} | {full_ms / less_ms:.2f}x |")
    print("| model | BatchNorms removed | full step (ms) | LessBN step (ms) | speed-up |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


def accuracy(args):
    """The two models take turns epoch by epoch, so that both see the same machine load."""
    (x, y), (xt, yt) = data.load_fashion_mnist("train"), data.load_fashion_mnist("test")
    order = np.random.default_rng(0).permutation(len(x))[:args.train_samples]
    x, y = x[order], y[order]
    models = {}
    for name in ("unmodified", "LessBN + FN + GC"):
        keras.utils.set_random_seed(0)
        base = demo_resnet(model_class=keras.Model)
        models[name] = compiled(base) if name == "unmodified" else \
            compiled(LessBN(base, fn_flag=True), gradient_centralization=True)
    epoch_times = {name: [] for name in models}
    for _ in range(args.epochs):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
            epoch_times[name].append(time.perf_counter() - start)
    print("| model | epoch times (s) | test accuracy |")
    print("|---|---|---|")
    for name, model in models.items():
        result = model.evaluate(xt, yt, batch_size=500, verbose=0, return_dict=True)
        times = ", ".join(f"{t:.1f}" for t in epoch_times[name])
        print(f"| {name} | {times} | {result['accuracy']:.4f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="steps per round")
    parser.add_argument("--train-samples", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--skip-step-times", action="store_true")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    if not args.skip_step_times:
        step_times(args)
    accuracy(args)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
