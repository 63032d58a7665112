"""Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py, ported to Keras 3 as a Horovod user would.

What changes from Horovod's script: `horovod.tensorflow.keras` (which does not work on Keras 3)
becomes keras_boost (`BoostModel` averages the gradients: no `DistributedOptimizer`; its callbacks
are `keras_boost.callbacks`), MNIST's download becomes Fashion-MNIST from the Debian package,
and the run is shorter (4 epochs of 8 steps per worker, batch 64). Everything else is the
example's: a `repeat().shuffle().batch()` dataset of unknown length per worker, Adam at
0.001 x size, the three callbacks, a checkpoint on rank 0 only, `steps_per_epoch` divided by size.

Then Horovod's `MetricAverageCallback` on a plain `keras.Model` (no gradient averaging: each rank
trains on its own data), with the logs recorded before and after it.
"""

import hashlib
import os
import tempfile

from common import report  # noqa: F401  (puts the repository on sys.path)

import keras
import numpy as np
import tensorflow as tf

import keras_boost
from keras_boost import distributed
from keras_boost.app.data import load_fashion_mnist
from tests.helpers import LearningRates

EPOCHS, STEPS_PER_EPOCH, BATCH = 4, 16, 64


class Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})


def example():
    size, rank = distributed.size(), distributed.rank()
    images, labels = load_fashion_mnist("train")
    images, labels = images[rank::size][:4096], labels[rank::size][:4096]
    dataset = tf.data.Dataset.from_tensor_slices((tf.cast(images, tf.float32), tf.cast(labels, tf.int64)))
    dataset = dataset.repeat().shuffle(10000, seed=rank).batch(BATCH)

    keras.utils.set_random_seed(rank)  # different initial weights: the broadcast must even them out
    inputs = keras.Input((28, 28, 1))
    h = inputs
    for layer in [keras.layers.Conv2D(32, [3, 3], activation="relu"),
                  keras.layers.Conv2D(64, [3, 3], activation="relu"),
                  keras.layers.MaxPooling2D(pool_size=(2, 2)),
                  keras.layers.Dropout(0.25),
                  keras.layers.Flatten(),
                  keras.layers.Dense(128, activation="relu"),
                  keras.layers.Dropout(0.5),
                  keras.layers.Dense(10, activation="softmax")]:
        h = layer(h)
    mnist_model = keras_boost.BoostModel(inputs, h)

    scaled_lr = 0.001 * size
    mnist_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=keras.optimizers.Adam(scaled_lr),
                        metrics=["accuracy"])
    rates = LearningRates()
    checkpoints = tempfile.mkdtemp(prefix=f"kb_hvd_example_{rank}_")
    cbs = [
        keras_boost.callbacks.BroadcastGlobalVariablesCallback(0),
        keras_boost.callbacks.MetricAverageCallback(),
        keras_boost.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
        rates,
    ]
    if rank == 0:
        cbs.append(keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "checkpoint-{epoch}.keras")))
    verbose = 1 if rank == 0 else 0
    history = mnist_model.fit(dataset, steps_per_epoch=2 * STEPS_PER_EPOCH // size, callbacks=cbs, epochs=EPOCHS,
                              verbose=verbose)
    saved = sorted(os.listdir(checkpoints))
    reloaded_equal = True
    if saved:
        reloaded = keras.models.load_model(os.path.join(checkpoints, saved[-1]))
        reloaded_equal = all(np.array_equal(a, b) for a, b in zip(reloaded.get_weights(), mnist_model.get_weights()))
    digest = hashlib.sha256(b"".join(w.tobytes() for w in mnist_model.get_weights())).hexdigest()
    return {"digest": digest, "rates": rates.rates, "steps_per_epoch": 2 * STEPS_PER_EPOCH // size,
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "checkpoints": saved, "reloaded_equal": reloaded_equal}


def plain_metric_average():
    rank = distributed.rank()
    rng = np.random.default_rng(10 + rank)  # each rank its own data
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 3))).argmax(axis=1)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    before, after = Logs(), Logs()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[before, keras_boost.callbacks.MetricAverageCallback(), after])
    return {"local": before.logs, "averaged": after.logs}


def run():
    distributed.init()
    return {**example(), "plain": plain_metric_average()}
