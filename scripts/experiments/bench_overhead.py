"""Overhead of the boost step on the demo model, measured side by side in one process.

    .venv/bin/python scripts/experiments/bench_overhead.py                  # single process: step-time ratios
    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python scripts/experiments/bench_overhead.py --allreduce

Single process: median step time of `BoostModel.fit` against `keras.Model.fit` on the same
model, data and weights, and of the loss-scaled step (fixed and dynamic scale, float32
policy) against the unscaled one. Configurations take turns for several rounds so that
machine noise falls on all of them alike. Under a launcher (`--allreduce`): the median
time of the one fused allreduce of the demo model's gradients, per step.
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
import tensorflow as tf  # noqa: E402

from keras_boost import BoostModel, DynamicLossScale, FixedLossScale, distributed  # noqa: E402
from keras_boost.app.demo_net import demo_resnet  # noqa: E402


def make(model_class, weights, **boost):
    model = demo_resnet(model_class=model_class)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"], **boost)
    return model


def single_process(args):
    rng = np.random.default_rng(0)
    x = rng.random((args.batch * args.steps, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    weights = demo_resnet().get_weights()
    configs = {
        "keras.Model": lambda: make(keras.Model, weights),
        "BoostModel": lambda: make(BoostModel, weights),
        "BoostModel + FixedLossScale": lambda: make(BoostModel, weights, loss_scale=FixedLossScale(1024.0)),
        "BoostModel + DynamicLossScale": lambda: make(BoostModel, weights, loss_scale=DynamicLossScale()),
    }
    models = {name: build() for name, build in configs.items()}
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, model in models.items():
            timer = StepTimer()
            model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, callbacks=[timer], shuffle=False)
            times[name].extend(timer.times[2:])  # the first steps of a round include tracing
    base = statistics.median(times["keras.Model"])
    unscaled = statistics.median(times["BoostModel"])
    print(f"load average before: {args.load}, after: {os.getloadavg()}")
    print("| configuration | median step (ms) | vs keras.Model | vs BoostModel |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {1000 * median:.1f} | {median / base:.3f} | {median / unscaled:.3f} |")


def allreduce_cost(args):
    distributed.init()
    model = demo_resnet()
    grads = [tf.ones_like(v) for v in model.trainable_variables]

    @tf.function
    def reduce():
        return distributed.grouped_allreduce(grads)

    reduce()
    samples = []
    for _ in range(args.steps):
        start = time.perf_counter()
        out = reduce()
        _ = out[0].numpy()
        samples.append(time.perf_counter() - start)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if distributed.rank() == 0:
        median = statistics.median(samples)
        print(f"{distributed.size()} workers ({distributed.capabilities()['controller']}): one fused allreduce of "
              f"{len(grads)} gradients ({params} floats) takes {1000 * median:.2f} ms (median of {len(samples)}); "
              f"{1e6 * median / (args.batch * distributed.size()):.1f} us per sample at batch {args.batch}/worker")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--allreduce", action="store_true", help="measure the allreduce (under a launcher)")
    args = parser.parse_args()
    args.load = os.getloadavg()
    allreduce_cost(args) if args.allreduce else single_process(args)


if __name__ == "__main__":
    main()
