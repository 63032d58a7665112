"""BatchNorm moving statistics on 2 workers: each rank trains on its own data, so each rank's
BatchNorms see other batches; fit averages the statistics at every epoch's end.

Two fits of a small conv-BN network: one with `AverageBatchNormStatistics` given by the user
between two recorders (the statistics before and after the average), one with fit's default.
"""

from common import report  # noqa: F401  (puts the repository on sys.path)

import keras
import numpy as np

from keras_boost import BoostModel, callbacks, distributed


def _stats(model):
    return [np.asarray(v).tolist() for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.stats = []

    def on_epoch_end(self, epoch, logs=None):
        self.stats.append(_stats(self.model))


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inputs)))
    h = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(h))
    model = BoostModel(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run():
    distributed.init()
    rng = np.random.default_rng(distributed.rank())
    x = (rng.normal(size=(64, 8, 8, 1)) * (1 + distributed.rank())).astype("float32")  # the ranks' data differ
    y = rng.integers(0, 3, 64)
    before, after = Record(), Record()
    model = _model()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[before, callbacks.AverageBatchNormStatistics(), after])
    default = _model()
    default.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return {"before": before.stats, "after": after.stats, "default": _stats(default)}
