"""The time from each epoch's start to its first step: Keras' per-epoch iterator and tf.data autotuning.

    .venv/bin/python scripts/experiments/bench_epoch_stalls.py --epochs 10

Trains the demo network (keras.Model or BoostModel, 30 steps of batch 64 per epoch) with
each way of giving the data, one process each, and prints, per epoch, the seconds between
`on_epoch_begin` and the first `on_train_batch_begin`. Keras makes a new iterator of the
data every epoch; with tf.data's autotuning on, destroying the previous one waits for the
autotuning thread to stop, on the main thread, before the first step.
"""

import os
import argparse
import json
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: F401,E402 (first: this checkout's keras_boost on sys.path, not the installed one)
from keras_boost.app import turns

MODES = {
    "keras-numpy": "keras.Model, NumPy arrays (Keras' own pipeline, autotuning on)",
    "boost-numpy": "BoostModel, NumPy arrays (keras_boost gives Keras its dataset with autotuning off)",
    "keras-dataset": "keras.Model, a tf.data.Dataset (from_tensor_slices.batch)",
    "keras-dataset-noautotune": "keras.Model, the same dataset with options.autotune.enabled = False",
    "keras-dataset-repeat": "keras.Model, the same dataset .repeat()ed, steps_per_epoch=30 (one iterator)",
}


def worker(mode, epochs):
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_boost import BoostModel
    from keras_boost.app.demo_net import demo_resnet

    class FirstStep(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.waits = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.waiting = time.perf_counter(), True

        def on_train_batch_begin(self, batch, logs=None):
            if self.waiting:
                self.waiting = False
                self.waits.append(round(time.perf_counter() - self.start, 2))

    keras.utils.set_random_seed(0)
    base = demo_resnet(model_class=keras.Model)
    model = (BoostModel if mode.startswith("boost") else keras.Model)(base.inputs, base.outputs)
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((30 * 64, 28, 28, 1), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x))
    timer = FirstStep()
    kwargs = dict(epochs=epochs, verbose=0, callbacks=[timer])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    if mode.endswith("numpy"):
        model.fit(x, y, batch_size=64, **kwargs)
    elif mode == "keras-dataset":
        model.fit(dataset, **kwargs)
    elif mode == "keras-dataset-noautotune":
        options = tf.data.Options()
        options.autotune.enabled = False
        model.fit(dataset.with_options(options), **kwargs)
    else:
        model.fit(dataset.repeat(), steps_per_epoch=30, **kwargs)
    print("RESULT " + json.dumps(timer.waits), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.epochs)
    print("| data | seconds from epoch start to first step, epochs 1.. | their sum |")
    print("|---|---|---|")
    for mode, what in MODES.items():
        waits = turns.run_once([sys.executable, __file__, "--worker", mode, "--epochs", str(args.epochs)],
                               timeout=600, name=mode)
        print(f"| {what} | {', '.join(f'{w:.2f}' for w in waits)} | {sum(waits):.2f} s |", flush=True)


if __name__ == "__main__":
    main()
