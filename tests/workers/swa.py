"""SWA on 2 workers, each on its own data: the averaged weights and the recomputed BatchNorm
statistics on each rank, and the statistics this rank's own batches give in NumPy."""

from common import report  # noqa: F401  (puts the repository on sys.path)

import keras
import numpy as np

from keras_boost import BoostModel, distributed


def run():
    distributed.init()
    rank = distributed.rank()
    rng = np.random.default_rng(rank)
    x = (rng.normal(size=(96, 8)) * (1 + rank)).astype("float32")  # the ranks' data differ
    y = rng.integers(0, 4, 96)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="swa_dense")(inputs)
    outputs = keras.layers.Dense(4, name="swa_logits")(keras.layers.ReLU()(keras.layers.BatchNormalization(name="swa_bn")(hidden)))
    model = BoostModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), swa=0.5,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    kernel, bias = (np.array(v) for v in model.get_layer("swa_dense").weights)
    batches = [x[i:i + 32] @ kernel + bias for i in range(0, len(x), 32)]
    bn = model.get_layer("swa_bn")
    return {"weights": [np.array(v).tolist() for v in model.trainable_variables],
            "count": int(model.boost_step.stage("swa").count.numpy()),
            "mean": np.array(bn.moving_mean).tolist(), "variance": np.array(bn.moving_variance).tolist(),
            "local_mean": np.mean([b.mean(0) for b in batches], axis=0).tolist(),
            "local_variance": np.mean([b.var(0) for b in batches], axis=0).tolist()}
