"""O1 must keep O0's accuracy on an ordinary softmax-headed CNN."""

import keras
import numpy as np

from keras_boost import BoostModel, FNHead
from keras_boost.config import MINDSPORE_DEFAULTS
from keras_boost.app.data import load_fashion_mnist


def _convnet():
    """keras-io mnist_convnet, narrower: no BatchNorm, Dropout, Dense(10, softmax) head."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dropout(0.5),
        keras.layers.Dense(10, activation="softmax"),
    ], name="convnet")


# MindSpore's less_bn section: the FN head is added whether or not LessBN removes a BatchNorm
WITH_FN = {"less_bn": MINDSPORE_DEFAULTS["less_bn"]}


def _accuracy(level, data, config=None):
    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(0)
    base = _convnet()
    model = BoostModel(base.inputs, base.outputs, boost_level=level, boost_config=config)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=128, epochs=3, verbose=0)
    return model, model.evaluate(xt, yt, batch_size=1000, verbose=0, return_dict=True)["accuracy"]


def test_o1_keeps_o0_accuracy_on_a_softmax_headed_cnn():
    x, y = load_fashion_mnist("train")
    xt, yt = load_fashion_mnist("test")
    order = np.random.default_rng(0).permutation(len(x))[:4000]
    data = ((x[order], y[order]), (xt, yt))  # the whole test set: 10000 images
    o0_model, o0 = _accuracy("O0", data)
    # keras_boost's O1: LessBN removes no BatchNorm here, so no FN head and no GC either
    o1_model, o1 = _accuracy("O1", data)
    assert [type(layer) for layer in o1_model.layers] == [type(layer) for layer in o0_model.layers]
    assert o1 >= o0 - 0.005, (o0, o1)
    # MindSpore's O1 adds the FN head anyway: its softmax stays a separate Activation after the head
    fn_model, with_fn = _accuracy("O1", data, WITH_FN)
    head = fn_model.layers[-2]
    assert isinstance(head, FNHead) and isinstance(fn_model.layers[-1], keras.layers.Activation)
    assert with_fn >= o0 - 0.005, (o0, with_fn)


def test_less_bn_fn_head_starts_at_a_cosine_classifier_scale():
    keras.utils.set_random_seed(0)
    base = _convnet()
    model = BoostModel(base.inputs, base.outputs, boost_level="O1", boost_config=WITH_FN)
    assert float(model.layers[-2].multiplier.numpy()) == 16.0
    assert FNHead(3).get_config()["initial_multiplier"] == 1.0  # a layer made by hand keeps MindSpore's 1.0
