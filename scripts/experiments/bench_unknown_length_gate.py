"""keras-io's mnist_convnet at a level on a tf.data pipeline of unknown length (a filter), 3 epochs of 64 steps.

Prints the whole fit's time and each epoch's (docs/benchmarks.md, "The gate with data of unknown length").

Usage: .venv/bin/python scripts/experiments/bench_unknown_length_gate.py O0|O1|O2|keras
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
from bench_common import EpochTimer  # noqa: E402  (this checkout's keras_boost on sys.path, log level)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_boost as kb  # noqa: E402
from keras_boost.app.data import load_fashion_mnist  # noqa: E402


def main(level):
    x, y = load_fashion_mnist("train")
    x, y = x[:8192], y[:8192]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(128).filter(lambda a, b: True)  # unknown length
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.MaxPooling2D(2)(keras.layers.Conv2D(32, 3, activation="relu")(inputs))
    h = keras.layers.MaxPooling2D(2)(keras.layers.Conv2D(64, 3, activation="relu")(h))
    outputs = keras.layers.Dense(10, activation="softmax")(keras.layers.Dropout(0.5)(keras.layers.Flatten()(h)))
    model = keras.Model(inputs, outputs) if level == "keras" else kb.BoostModel(inputs, outputs, boost_level=level)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    epochs = EpochTimer()
    start = time.perf_counter()
    model.fit(dataset, epochs=3, verbose=0, callbacks=[epochs])
    print("RESULT", level, f"fit {time.perf_counter() - start:.2f}", "epochs",
          " ".join(f"{t:.2f}" for t in epochs.times), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
