"""Small models and data shared by the single-process tests."""

import keras
import numpy as np

from keras_boost import BoostModel
def mlp(model_class=BoostModel, inputs=8, hidden=16, classes=4, seed=0):
    """A two-layer MLP without BatchNorm or dropout, with seeded initial weights."""
    keras.utils.set_random_seed(seed)
    x_in = keras.Input((inputs,))
    h = keras.layers.Dense(hidden, activation="tanh", name="hidden")(x_in)
    out = keras.layers.Dense(classes, name="logits")(h)
    return model_class(x_in, out)


def classification_data(n=128, inputs=8, classes=4, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(inputs, classes)), axis=1).astype(np.int32)  # learnable labels
    return x, y


def compile_sgd(model, lr=0.1, momentum=0.9, **boost):
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **boost)
    return model


def weights(model):
    return [np.array(w) for w in model.trainable_weights]


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


class LearningRates(keras.callbacks.Callback):
    """The optimizer's learning rate after every training batch (the rate that batch used)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))
