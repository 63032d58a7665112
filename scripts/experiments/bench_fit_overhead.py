"""What `fit` costs per step against a hand-written loop, on one pinned core, without a network.

    .venv/bin/python scripts/experiments/bench_fit_overhead.py --rounds 3

The question it answers: on the many-host benchmark (scripts/bench_hosts.py) Horovod's
hand-written loop ran the demo model faster than keras_boost on fast links, and on one
host too, where nothing is communicated. One process per run (`keras_boost.app.turns`),
each pinned to core 0 with one TensorFlow intra-op and one inter-op thread (as
bench_hosts pins its workers), the demo model at batch 32, SGD with momentum, synthetic
data from `Dataset.from_tensors(...).repeat()`:

    loop        a `tf.function` step (tape, gradient, `optimizer.apply_gradients`) called from
                a Python loop over the dataset's iterator: Horovod's example without Horovod
    keras       `keras.Model.fit(dataset, steps_per_epoch=N)`
    O0          `BoostModel.fit` with every option off (one process: no collective)
    O0-noguard  the same with `compile(nan_guard=False)`

The timed window: the end of the last warm-up step to the end of the last step (as
bench_hosts), per-step milliseconds reported.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: F401,E402 (this checkout's keras_boost first on sys.path)

from keras_boost.app import turns  # noqa: E402

CONFIGS = ("loop", "keras", "O0", "O0-noguard")


def worker(config, warmup, steps, batch):
    os.sched_setaffinity(0, {0})
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from keras_boost import BoostModel
    from keras_boost.app.demo_net import demo_resnet

    keras.utils.set_random_seed(0)
    model = demo_resnet(model_class=keras.Model if config in ("loop", "keras") else BoostModel)
    rng = np.random.default_rng(0)
    x = rng.random((batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ends = []
    if config == "loop":
        optimizer.build(model.trainable_variables)

        @tf.function
        def step(bx, by):
            with tf.GradientTape() as tape:
                loss = loss_fn(by, model(bx, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        iterator = iter(dataset)
        for _ in range(warmup + steps):
            bx, by = next(iterator)
            step(bx, by).numpy()
            ends.append(time.perf_counter())
    else:
        options = {"nan_guard": False} if config == "O0-noguard" else {}
        model.compile(optimizer=optimizer, loss=loss_fn, **options)

        class Ends(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                ends.append(time.perf_counter())

        model.fit(dataset, steps_per_epoch=warmup + steps, epochs=1, verbose=0, callbacks=[Ends()])
    window = ends[warmup + steps - 1] - ends[warmup - 1]
    print("RESULT " + json.dumps({"step_ms": 1000 * window / steps}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.warmup, args.steps, args.batch_size)
    print(f"load average before: {os.getloadavg()}", flush=True)

    def command(config, round_index):
        return [sys.executable, os.path.abspath(__file__), "--worker", config, "--warmup", str(args.warmup),
                "--steps", str(args.steps), "--batch-size", str(args.batch_size)]

    def report(config, round_index, result):
        print(f"round {round_index + 1} {config}: {result['step_ms']:.2f} ms per step", flush=True)

    results = turns.take_turns(args.configs, args.rounds, command, timeout=600, report=report)
    reference = turns.median([r["step_ms"] for r in results[args.configs[0]]])
    print(f"\n| configuration | ms per step (median [range]) | speed vs {args.configs[0]} |\n|---|---|---|")
    for config, runs in results.items():
        values = [r["step_ms"] for r in runs]
        print(f"| {config} | {turns.median_range(values, 2)} | {reference / turns.median(values):.3f}x |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
