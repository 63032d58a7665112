"""Stochastic weight averaging (`compile(swa=...)`): the average, the BatchNorm pass, options, saving."""

import keras
import numpy as np
import pytest

from keras_boost import BoostModel
from keras_boost.stages.swa import StochasticWeightAveraging
from tests.helpers import classification_data, compile_sgd, mlp


def _bn_net(seed=0):
    """Dense -> BatchNorm -> ReLU -> Dense; the BatchNorm reads the first Dense's output directly."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="swa_dense")(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(name="swa_bn")(hidden))
    return BoostModel(inputs, keras.layers.Dense(4, name="logits")(h))


class _EpochEnds(keras.callbacks.Callback):
    """The trainable weights at every epoch's end, as NumPy copies."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append([np.array(v) for v in self.model.trainable_variables])


@pytest.mark.parametrize("swa, averaged", [(0.5, [2, 3]), (1, [1, 2, 3]), (True, [3]), (0.0, [0, 1, 2, 3])])
def test_the_weights_end_as_the_mean_of_the_epoch_ends_from_the_start_on(swa, averaged):
    x, y = classification_data(n=128)
    model = compile_sgd(mlp(), swa=swa)
    ends = _EpochEnds()
    model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[ends])
    assert int(model.boost_step.stage("swa").count.numpy()) == len(averaged)
    for index, variable in enumerate(model.trainable_variables):
        expected = np.mean([ends.seen[epoch][index] for epoch in averaged], axis=0)
        # a running mean against NumPy's sum-then-divide: float32 rounding apart
        np.testing.assert_allclose(np.array(variable), expected, rtol=1e-5, atol=1e-6)


def test_batchnorm_statistics_are_the_mean_batch_statistics_of_the_averaged_weights():
    x, y = classification_data(n=160)
    model = compile_sgd(_bn_net(), swa=0.5)
    model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    # Independent reference in NumPy: the first Dense's output under the averaged weights, per
    # batch of fit (unshuffled, 32 rows), its mean and population variance, averaged over batches.
    kernel, bias = (np.array(v) for v in model.get_layer("swa_dense").weights)
    batches = [x[i:i + 32] @ kernel + bias for i in range(0, len(x), 32)]
    bn = model.get_layer("swa_bn")
    np.testing.assert_allclose(np.array(bn.moving_mean), np.mean([b.mean(0) for b in batches], axis=0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(bn.moving_variance), np.mean([b.var(0) for b in batches], axis=0),
                               rtol=1e-5, atol=1e-6)
    assert bn.momentum == 0.99  # the layer's own momentum is back


def test_without_the_batchnorm_pass_the_statistics_stay_those_of_training():
    x, y = classification_data(n=160)
    model = compile_sgd(_bn_net(), swa=StochasticWeightAveraging(start=0.5, batchnorm_pass=False))
    trained = {}

    class Keep(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            trained["mean"] = np.array(self.model.get_layer("swa_bn").moving_mean)

    model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[Keep()])
    np.testing.assert_array_equal(np.array(model.get_layer("swa_bn").moving_mean), trained["mean"])


def test_a_dataset_and_steps_per_epoch_feed_the_batchnorm_pass_as_fit_read_them():
    import tensorflow as tf

    x, y = classification_data(n=256)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    model = compile_sgd(_bn_net(), swa=0.5)
    model.fit(data, steps_per_epoch=3, epochs=2, verbose=0)  # an endless dataset: 3 batches per epoch
    kernel, bias = (np.array(v) for v in model.get_layer("swa_dense").weights)
    batches = [x[i:i + 32] @ kernel + bias for i in range(0, 96, 32)]
    np.testing.assert_allclose(np.array(model.get_layer("swa_bn").moving_mean),
                               np.mean([b.mean(0) for b in batches], axis=0), rtol=1e-5, atol=1e-6)


def test_a_fit_that_ends_before_the_start_keeps_its_weights_and_says_so():
    x, y = classification_data(n=64)
    model = compile_sgd(mlp(), swa=5)
    ends = _EpochEnds()
    with pytest.warns(UserWarning, match="no epoch's weights were averaged"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[ends])
    for variable, last in zip(model.trainable_variables, ends.seen[-1]):
        np.testing.assert_array_equal(np.array(variable), last)


def test_evaluate_and_save_use_the_average(tmp_path):
    x, y = classification_data(n=128)
    model = _bn_net()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"], swa=0.5,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    path = str(tmp_path / "swa.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    stage = loaded.boost_step.stage("swa")
    assert stage.start == 0.5 and stage.batchnorm_pass and int(stage.count.numpy()) == 2
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-6)


def test_the_compiled_step_is_unchanged():
    """SWA runs between epochs and after fit: the step's graph runs the same ops as without it."""
    from keras_boost.app.step_ops import op_counts

    x, y = classification_data(n=32)

    def ops(**boost):
        model = compile_sgd(mlp(), **boost)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        return op_counts(model)

    with_swa = ops(swa=True)
    assert sum(with_swa.values()) > 0 and with_swa == ops()


@pytest.mark.parametrize("value, error, words", [
    ("yes", TypeError, "`swa` must be None, a bool, a float in [0, 1), an int >= 0 or a StochasticWeightAveraging, "
                       "got 'yes' (str)"),
    (1.5, ValueError, "`start` as a fraction of the fit's epochs must be in [0, 1), got 1.5"),
    (-1, ValueError, "`start` as an epoch index must be >= 0, got -1"),
])
def test_a_bad_swa_option_is_refused_at_compile(value, error, words):
    with pytest.raises(error) as caught:
        compile_sgd(mlp(), swa=value)
    assert words in str(caught.value)


def test_a_bad_batchnorm_pass_is_refused():
    with pytest.raises(TypeError, match=r"`batchnorm_pass` must be a bool, got 'no' \(str\)"):
        StochasticWeightAveraging(batchnorm_pass="no")


def test_on_two_workers_every_rank_ends_with_the_same_average_and_statistics_of_all_data():
    from tests.launch import shared

    found = shared("gloo", "swa")
    r0, r1 = found[0], found[1]
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["count"] == r1["count"] == 2
    assert r0["weights"] == r1["weights"]  # bit-identical averages
    assert r0["mean"] == r1["mean"] and r0["variance"] == r1["variance"]
    assert np.max(np.abs(np.subtract(r0["local_mean"], r1["local_mean"]))) > 1e-2  # each rank's data apart
    for name in ("mean", "variance"):  # the mean over both ranks' batches, each rank's computed in NumPy
        expected = (np.array(r0[f"local_{name}"]) + np.array(r1[f"local_{name}"])) / 2
        np.testing.assert_allclose(r0[name], expected, rtol=1e-5, atol=1e-6)


def test_keras_boost_train_swa_flag_averages_and_reports():
    import json

    from tests.test_cli import keras_boost

    result = keras_boost("train", "--dataset", "synthetic", "--train-samples", "256", "--epochs", "2",
                         "--batch-size", "32", "--steps-per-epoch", "3", "--swa", "0.5", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "swa: the weights are now the average of 1 epoch ends" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["swa_epochs_averaged"] == 1
    refused = keras_boost("train", "--swa", "1.5")
    assert refused.returncode == 2 and "must be in [0, 1), got 1.5" in refused.stderr
