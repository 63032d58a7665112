"""2 workers train a model with an `Embedding` (sparse gradients: `tf.IndexedSlices`)
with batch b against 1 process (plain Keras) with batch 2b, on the same data.

The boost step runs the NaN guard, with and without a loss scale (fixed, a power of 2:
exact), and gradient centralization "all" (the Embedding table included, made dense as the keras-io
recipe does); the reference is keras.Model with `keras_boost.optimizers.CentralizedOptimizer`
(the same recipe, `GradientCentralization.every_kernel()`, as an optimizer wrapper) and no loss scale. Prints per rank the largest weight
difference to the reference and a hash of the weights.
"""

import hashlib

import keras
import numpy as np

from keras_boost import BoostModel, GradientCentralization, distributed
from keras_boost.optimizers import CentralizedOptimizer
from tests.helpers import max_diff, weights
from train_equivalence import interleave_shard

VOCABULARY, LENGTH = 50, 8


def net(model_class, seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCABULARY, 16, name="embedding")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(h)
    return model_class(inputs, keras.layers.Dense(3, name="head")(h))


def run():
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    rng = np.random.default_rng(11)
    x = rng.integers(0, 20, (128, LENGTH)).astype(np.int32)  # rows 20-49 of the table get no gradient
    y = rng.integers(0, 3, 128)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per_worker = 16

    reference = net(keras.Model, seed=0)
    reference.compile(optimizer=CentralizedOptimizer(keras.optimizers.SGD(0.2, momentum=0.9),
                                                     GradientCentralization.every_kernel()), loss=loss)
    reference.fit(x, y, batch_size=per_worker * size, epochs=2, shuffle=False, verbose=0)

    found = {}
    for name, options in (("guard", {}), ("loss_scale", {"loss_scale": 1024.0})):
        model = net(BoostModel, seed=rank + 3)  # the workers start apart: fit broadcasts rank 0's weights
        if rank == 0:
            model.set_weights(net(keras.Model, seed=0).get_weights())
        model.compile(optimizer=keras.optimizers.SGD(0.2, momentum=0.9), loss=loss, gradient_centralization="all",
                      **options)
        xs, ys = (interleave_shard(a, per_worker, rank, size) for a in (x, y))
        model.fit(xs, ys, batch_size=per_worker, epochs=2, shuffle=False, verbose=0)
        untouched = np.array(model.get_layer("embedding").embeddings)[20:]
        start = np.array(net(keras.Model, seed=0).get_layer("embedding").embeddings)[20:]
        found[name] = dict(diff=max_diff(weights(reference), weights(model)),
                           digest=hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest(),
                           untouched_rows_moved=float(np.abs(untouched - start).min()))
    found["moved"] = max_diff(weights(reference), [np.array(v) for v in net(keras.Model, seed=0).weights])
    return found
