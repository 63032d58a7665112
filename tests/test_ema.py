"""The weights' exponential moving average (`compile(ema=...)`, on at O2): the average, where it is used, options."""

import keras
import numpy as np
import pytest

from keras_boost import BoostModel
from keras_boost.stages.ema import ExponentialMovingAverage
from tests.helpers import classification_data, compile_sgd, mlp


class _Trained(keras.callbacks.Callback):
    """The trainable weights after every batch (the weights being trained), as NumPy copies."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([np.array(v) for v in self.model.trainable_variables])


def _numpy_average(seen, decay, warmup):
    """The average of NumPy's own: the n-th update (from 0) decays by 0 (n = 0), else min(decay, (1+n)/(10+n))."""
    average = None
    for n, weights in enumerate(seen):
        d = 0.0 if n == 0 else (min(decay, (1 + n) / (10 + n)) if warmup else decay)
        average = [np.float32(d) * a + np.float32(1 - d) * w for a, w in zip(average or weights, weights)]
    return average


@pytest.mark.parametrize("decay, warmup", [(0.9, True), (0.6, False)])
def test_the_model_ends_with_the_average_of_the_trained_weights_after_every_update(decay, warmup):
    x, y = classification_data(n=96)
    model = compile_sgd(mlp(), ema=ExponentialMovingAverage(decay, warmup=warmup))
    trained = _Trained()
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, callbacks=[trained])
    stage = model.boost_step.stage("ema")
    assert int(stage.count.numpy()) == len(trained.seen) == 18
    for variable, expected in zip(model.trainable_variables, _numpy_average(trained.seen, decay, warmup)):
        # the step's `v + d * (a - v)` against NumPy's `d * a + (1 - d) * v`: float32 rounding apart
        np.testing.assert_allclose(np.array(variable), expected, rtol=1e-5, atol=1e-6)
    for average, last in zip(stage.average, trained.seen[-1]):  # the trained weights are kept beside it
        np.testing.assert_array_equal(np.array(average), last)


def test_without_warmup_the_average_remembers_the_first_weights_longer():
    """The warm-up is what lets the first epochs' average follow the weights (Keras' use_ema has none)."""
    x, y = classification_data(n=96)
    ends = {}
    for warmup in (True, False):
        model = compile_sgd(mlp(), ema=ExponentialMovingAverage(0.99, warmup=warmup))
        trained = _Trained()
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[trained])
        ends[warmup] = max(float(np.max(np.abs(np.array(v) - w))) for v, w in
                           zip(model.trainable_variables, trained.seen[-1]))
    assert ends[True] < 0.5 * ends[False]


def test_validation_and_the_epoch_end_callbacks_see_the_average_and_each_epoch_trains_the_trained_weights():
    x, y = classification_data(n=96)
    x_val, y_val = classification_data(n=64, seed=7)
    model = compile_sgd(mlp(), ema=0.8)
    stage_log = []

    class AtEpochEnd(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            stage_log.append(("begin", [np.array(v) for v in self.model.trainable_variables]))

        def on_epoch_end(self, epoch, logs=None):
            stage = self.model.boost_step.stage("ema")
            loss = self.model.evaluate(x_val, y_val, batch_size=64, verbose=0, return_dict=True)["loss"]
            stage_log.append(("end", loss, logs["val_loss"], [np.array(a) for a in stage.average]))

    trained = _Trained()
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, validation_data=(x_val, y_val),
              validation_batch_size=64, callbacks=[trained, AtEpochEnd()])
    ends = [entry for entry in stage_log if entry[0] == "end"]
    begins = [entry for entry in stage_log if entry[0] == "begin"]
    for _, evaluated, validated, _ in ends:  # the same weights, the same single batch
        assert evaluated == pytest.approx(validated, rel=1e-6)
    # at each epoch's end the trained weights wait in the stage; the next epoch starts from them
    for epoch in range(1, 3):
        for held, resumed, last in zip(ends[epoch - 1][3], begins[epoch][1], trained.seen[6 * epoch - 1]):
            np.testing.assert_array_equal(held, last)
            np.testing.assert_array_equal(resumed, last)
    plain = compile_sgd(mlp())
    history = plain.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, validation_data=(x_val, y_val),
                        validation_batch_size=64)
    # the trained weights are the plain model's (the average changes no update): only validation differs
    for a, b in zip(plain.trainable_variables, ends[-1][3]):
        np.testing.assert_allclose(np.array(a), b, rtol=1e-6, atol=1e-7)
    assert all(abs(e[2] - v) > 1e-4 for e, v in zip(ends, history.history["val_loss"]))


def test_a_second_fit_trains_on_from_the_trained_weights_as_one_longer_fit_does():
    x, y = classification_data(n=96)
    once = compile_sgd(mlp(), ema=0.9)
    once.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    twice = compile_sgd(mlp(), ema=0.9)
    twice.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    twice.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(once.weights, twice.weights):  # the same compiled step on the same batches
        np.testing.assert_array_equal(np.array(a), np.array(b))
    stage = twice.boost_step.stage("ema")
    assert int(stage.count.numpy()) == 12 and bool(stage.swapped.numpy())


def test_save_and_load_keep_the_average_its_side_and_the_trained_weights(tmp_path):
    x, y = classification_data(n=96)
    model = compile_sgd(mlp(), ema=0.9)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / "ema.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.boost_step.stage("ema").decay == 0.9
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_o2_keeps_the_average_o1_does_not_and_the_configuration_switches_it():
    def stage(level, config=None):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        model = BoostModel(inputs, keras.layers.Dense(4)(inputs), boost_level=level, boost_config=config)
        compile_sgd(model)
        return model.boost_step.stage("ema")

    assert isinstance(stage("O2"), ExponentialMovingAverage) and stage("O2").decay == 0.99
    assert stage("O1") is None and stage("O0") is None
    assert stage("O2", {"boost": {"ema": False}}) is None
    assert isinstance(stage("O1", {"boost": {"ema": True}}), ExponentialMovingAverage)
    with pytest.raises(TypeError, match=r"boost_config\['boost'\]\['ema'\]"):
        stage("O2", {"boost": {"ema": "yes"}})


@pytest.mark.parametrize("value, error, words", [
    ("0.9", TypeError, "`ema` must be None, a bool, a float in (0, 1) or an ExponentialMovingAverage, got '0.9' (str)"),
    (1.0, ValueError, "`decay` must be in (0, 1) (0.99 remembers about the last 100 updates), got 1.0"),
    (0, ValueError, "`decay` must be in (0, 1)"),
])
def test_a_bad_ema_option_is_refused_at_compile(value, error, words):
    with pytest.raises(error) as caught:
        compile_sgd(mlp(), ema=value)
    assert words in str(caught.value)


def test_a_bad_warmup_is_refused():
    with pytest.raises(TypeError, match=r"`warmup` must be a bool, got 1 \(int\)"):
        ExponentialMovingAverage(warmup=1)


def test_keras_boost_train_ema_flag_averages_and_reports():
    import json

    from tests.test_cli import keras_boost

    result = keras_boost("train", "--dataset", "synthetic", "--train-samples", "256", "--epochs", "2",
                         "--batch-size", "32", "--steps-per-epoch", "3", "--ema", "0.9", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["ema_updates"] == 6
    refused = keras_boost("train", "--ema", "1.5")
    assert refused.returncode == 2 and "--ema must be in (0, 1)" in refused.stderr
