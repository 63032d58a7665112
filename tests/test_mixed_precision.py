"""Mixed precision with the boost step reaches the float32 accuracy on Fashion-MNIST.

An MLP is used: on this CPU float16 convolutions fall back to Eigen and run about 100x
slower than float32 (measured: 6 s per demo-model step), which no test suite can afford;
the demo model's float16 and bfloat16 runs are in docs/benchmarks.md.
"""

import keras
import numpy as np
import pytest

from keras_boost import BoostModel
from keras_boost.app import data
_RESULTS = {}


def train(policy):
    if policy not in _RESULTS:
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        (x, y), (xt, yt) = data.load_fashion_mnist("train"), data.load_fashion_mnist("test")
        inputs = keras.Input((28, 28, 1))
        h = keras.layers.Flatten()(inputs)
        h = keras.layers.Dense(256, activation="relu")(h)
        h = keras.layers.Dense(128, activation="relu")(h)
        outputs = keras.layers.Dense(10, dtype="float32")(h)  # float32 logits
        model = BoostModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        history = model.fit(x[:16384], y[:16384], batch_size=64, epochs=3, verbose=0)
        _RESULTS[policy] = (model, history, model.evaluate(xt, yt, batch_size=1000, verbose=0, return_dict=True))
    return _RESULTS[policy]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_matches_float32_accuracy(policy):
    reference = train("float32")[2]["accuracy"]
    model, history, result = train(policy)
    assert reference > 0.8
    assert abs(result["accuracy"] - reference) <= 0.01, (policy, result["accuracy"], reference)
    assert all(v.dtype == "float32" for v in model.trainable_variables)  # float32 master weights
    if policy == "mixed_float16":
        assert model.boost_step.loss_scale is not None
        assert set(history.history["overflow"]) <= {0, 1} and np.all(np.array(history.history["loss_scale"]) >= 1)
    else:
        assert model.boost_step.loss_scale is None and "loss_scale" not in history.history
