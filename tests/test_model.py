"""BoostModel in one process, against Keras' own training as the reference."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_boost
from keras_boost import BoostModel, BoostTrainOneStep
from keras_boost.app.demo_net import demo_resnet
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights


def test_matches_plain_keras_fit():
    x, y = classification_data()
    reference = compile_sgd(mlp(keras.Model))
    boosted = compile_sgd(mlp(BoostModel))
    assert max_diff(weights(reference), weights(boosted)) == 0.0
    ref_hist = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    boost_hist = boosted.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_diff(weights(reference), weights(boosted)) < 1e-6
    np.testing.assert_allclose(boost_hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(boost_hist.history["accuracy"], ref_hist.history["accuracy"])


def test_subclassed_model_trains():
    class Net(BoostModel):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(4)

        def call(self, x):
            return self.out(self.hidden(x))

    x, y = classification_data()
    model = compile_sgd(Net())
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_sens_scales_the_gradient_like_the_seed():
    x, y = classification_data(n=32)
    reference = compile_sgd(mlp(keras.Model), lr=0.2, momentum=0.0)
    scaled = compile_sgd(mlp(BoostModel), lr=0.1, momentum=0.0, sens=2.0)
    reference.fit(x, y, batch_size=32, epochs=1, verbose=0)
    scaled.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert max_diff(weights(reference), weights(scaled)) < 1e-6


@pytest.mark.parametrize("sens, error", [("2", TypeError), (None, TypeError), (True, TypeError),
                                         (0.0, ValueError), (float("nan"), ValueError)])
def test_bad_sens(sens, error):
    with pytest.raises(error, match="sens"):
        compile_sgd(mlp(), sens=sens)


def test_step_rejects_bad_arguments():
    model = mlp()
    with pytest.raises(TypeError, match="optimizer"):
        BoostTrainOneStep(model, "sgd")
    with pytest.raises(TypeError, match="model"):
        BoostTrainOneStep(object(), keras.optimizers.SGD())


def test_untrained_variables_get_no_update():
    """A variable with no gradient path (None gradient) is neither updated nor decayed."""
    x_in = keras.Input((4,))
    used = keras.layers.Dense(2, name="used")(x_in)
    unused = keras.layers.Dense(2, name="unused")(x_in)
    model = BoostModel(x_in, [used, unused])
    model.compile(optimizer=keras.optimizers.AdamW(0.1, weight_decay=0.5), loss=["mse", None])
    before = np.array(model.get_layer("unused").kernel)
    x = np.ones((8, 4), np.float32)
    model.fit(x, np.zeros((8, 2), np.float32), epochs=1, verbose=0)
    np.testing.assert_array_equal(before, np.array(model.get_layer("unused").kernel))


def test_boost_state_is_saved_with_the_model(tmp_path):
    model = compile_sgd(mlp(), loss_scale=keras_boost.DynamicLossScale(init_scale=256.0))
    model.boost_step.stage("loss_scale").scale.assign(128.0)
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    other = compile_sgd(mlp(), loss_scale=keras_boost.DynamicLossScale(init_scale=256.0))
    other.load_weights(path)
    assert float(other.boost_step.stage("loss_scale").scale.numpy()) == 128.0


def test_demo_model_shape():
    model = demo_resnet()
    bns = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
    assert len(bns) == len(convs) == 9
    out = model(tf.zeros((2, 28, 28, 1)))
    assert out.shape == (2, 10)


def test_nan_guard_stops_before_the_weights_are_touched():
    x, y = classification_data(n=64)
    x = x.copy()
    x[40, 0] = np.nan  # third batch of 16
    model = compile_sgd(mlp(), nan_guard=True)
    seen = []
    with pytest.raises(FloatingPointError, match="non-finite gradient at batch 2"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: seen.append(
                      [np.array(w) for w in model.trainable_weights]))])
    assert all(np.isfinite(w).all() for w in weights(model))
    for a, b in zip(seen[-1], weights(model)):
        np.testing.assert_array_equal(a, b)  # the refused update left the weights as they were
    assert int(model.optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("option", [{}, {"nan_guard": False}])
def test_without_the_nan_guard_a_non_finite_update_is_applied_like_keras(option):
    """The default (no guard, as keras.Model): the step has no finite check and writes the NaN update."""
    x, y = classification_data(n=32)
    x = x.copy()
    x[0, 0] = np.nan
    model = compile_sgd(mlp(), **option)
    assert model.boost_step.stage("nan_guard") is None
    reference = compile_sgd(mlp(keras.Model))
    reference.set_weights(model.get_weights())
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    reference.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert not all(np.isfinite(w).all() for w in weights(model))
    for a, b in zip(weights(model), weights(reference)):
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))  # the same values turned NaN
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 2
    with pytest.raises(TypeError, match="`nan_guard` must be a bool"):
        compile_sgd(mlp(), nan_guard="yes")


def test_an_epoch_of_unknown_length_counts_only_the_updates_it_applied():
    """The call whose `get_next` ends an epoch of unknown length applies nothing and counts nothing.

    keras.Model's inlined step runs the optimizer's `iterations += 1` on that call too (one
    count more per epoch than updates applied; Adam's bias correction reads it). BoostModel on
    the dataset equals keras.Model on the same batches as arrays (known length), with Adam.
    """
    x, y = classification_data(n=64)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(16)
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY

    def adam(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    boosted = adam(mlp(BoostModel))
    reference = adam(mlp(keras.Model))
    boosted.fit(dataset, epochs=3, verbose=0)
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert int(boosted.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 12
    # different data paths, one float program per batch: equal up to rounding
    for a, b in zip(weights(boosted), weights(reference)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
