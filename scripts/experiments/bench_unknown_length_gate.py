"""keras-io mnist_convnet at a level on a tf.data pipeline of unknown length (a filter), 3 epochs of 64 steps: whole fit and per-epoch times (docs/benchmarks.md, "The gate with data of unknown length").

Usage: .venv/bin/python scripts/experiments/bench_unknown_length_gate.py O0|O1|keras
"""
import sys, time, numpy as np, keras, tensorflow as tf
import keras_boost as kb
from keras_boost.app.data import load_fashion_mnist
level = sys.argv[1]
x, y = load_fashion_mnist("train"); x, y = x[:8192], y[:8192]
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(128).filter(lambda a, b: True)
keras.utils.set_random_seed(0)
inputs = keras.Input((28, 28, 1))
h = keras.layers.Conv2D(32, 3, activation="relu")(inputs); h = keras.layers.MaxPooling2D(2)(h)
h = keras.layers.Conv2D(64, 3, activation="relu")(h); h = keras.layers.MaxPooling2D(2)(h)
h = keras.layers.Dropout(0.5)(keras.layers.Flatten()(h))
out = keras.layers.Dense(10, activation="softmax")(h)
model = keras.Model(inputs, out) if level == "keras" else kb.BoostModel(inputs, out, boost_level=level)
model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
times = []
class T(keras.callbacks.Callback):
    def on_epoch_begin(self, e, logs=None): self.t = time.perf_counter()
    def on_epoch_end(self, e, logs=None): times.append(time.perf_counter() - self.t)
t = time.perf_counter()
model.fit(ds, epochs=3, verbose=0, callbacks=[T()])
print("RESULT", level, "fit %.2f" % (time.perf_counter() - t), "epochs", " ".join("%.2f" % s for s in times), flush=True)
