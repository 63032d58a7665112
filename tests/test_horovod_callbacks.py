"""Horovod's Keras callbacks in their Keras 3 form: the warm-up against NumPy, the metric average
on 2 workers, and Horovod's own tensorflow2_keras_mnist.py example ported (tests/workers/horovod_example.py)."""

import keras
import numpy as np
import pytest

from keras_boost import BoostModel, callbacks
from tests.helpers import LearningRates
from tests.launch import shared, shared_output

BATCH, STEPS, EPOCHS, WARMUP_EPOCHS = 8, 4, 3, 2
LR, MOMENTUM, START = 0.05, 0.9, 0.25


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH * STEPS, 3))
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.1 * rng.normal(size=BATCH * STEPS)
    return x, y


def _numpy_warmup(correction):
    """Keras' SGD with momentum (m = momentum * m - lr * g; w += m) on the mean squared error, in float64,
    the rate warmed up linearly from START * LR to LR over WARMUP_EPOCHS epochs, per update."""
    x, y = _data()
    w, m = np.zeros(3), np.zeros(3)
    warmup = WARMUP_EPOCHS * STEPS
    factor = [START + (1 - START) * min(t / warmup, 1.0) for t in range(EPOCHS * STEPS)]
    rates = []
    for t in range(EPOCHS * STEPS):
        rows = slice((t % STEPS) * BATCH, (t % STEPS + 1) * BATCH)
        grad = 2.0 / BATCH * x[rows].T @ (x[rows] @ w - y[rows])
        if correction and 0 < t <= warmup:
            m *= factor[t] / factor[t - 1]
        rates.append(LR * factor[t])
        m = MOMENTUM * m - rates[-1] * grad
        w = w + m
    return w, rates


@pytest.mark.parametrize("model_class", [keras.Model, BoostModel])
@pytest.mark.parametrize("correction", [True, False])
def test_warmup_with_momentum_correction_equals_numpy(model_class, correction):
    x, y = _data()
    inputs = keras.Input((3,))
    model = model_class(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM), loss="mse")
    rates = LearningRates()
    warmup = callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=WARMUP_EPOCHS,
                                                  momentum_correction=correction, start_factor=START)
    model.fit(x.astype("float32"), y.astype("float32"), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[warmup, rates])
    expected, expected_rates = _numpy_warmup(correction)
    np.testing.assert_allclose(rates.rates, expected_rates, rtol=1e-6)  # float32 rate variable
    # float32 against float64 over 12 updates: within 1e-4 of each weight (about 2)
    np.testing.assert_allclose(model.get_weights()[0].ravel(), expected, rtol=1e-4, atol=1e-5)
    other, _ = _numpy_warmup(not correction)
    assert np.max(np.abs(expected - other)) > 1e-2  # the correction changes the result: the test can tell


def test_warmup_arguments_are_horovods():
    warmup = callbacks.LearningRateWarmupCallback(0.1, 3, False, 10, 1)  # Horovod's positional order
    assert (warmup.initial_lr, warmup.warmup_epochs, warmup.momentum_correction, warmup.steps_per_epoch,
            warmup.verbose) == (0.1, 3, False, 10, 1)
    with pytest.raises(TypeError, match="`momentum_correction` must be a bool"):
        callbacks.LearningRateWarmupCallback(0.1, momentum_correction="yes")
    with pytest.raises(TypeError):
        callbacks.LearningRateWarmupCallback(0.1, 3, False, 10, 1, 0.5)  # start_factor is keyword only


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovods_mnist_example_ported_to_keras_3_on_two_workers(controller):
    found = shared(controller, "horovod_example")
    r0, r1 = found[0], found[1]
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["digest"] == r1["digest"]  # bit-identical weights on both ranks
    size, scaled_lr, steps, warmup_epochs = 2, 0.002, r0["steps_per_epoch"], 3
    expected = [scaled_lr * (1 / size + (1 - 1 / size) * min(t / (warmup_epochs * steps), 1.0))
                for t in range(len(r0["rates"]))]
    np.testing.assert_allclose(r0["rates"], expected, rtol=1e-6)
    assert r0["rates"] == r1["rates"] and r0["rates"][-1] == pytest.approx(scaled_lr)
    assert r0["history"]["loss"][-1] < 0.8 * r0["history"]["loss"][0], r0["history"]  # it learns
    assert r0["checkpoints"] and not r1["checkpoints"]  # ModelCheckpoint on rank 0 only
    assert r0["reloaded_equal"]


def test_metric_average_callback_averages_a_plain_keras_models_logs():
    found = shared("gloo", "horovod_example")
    local = [found[rank]["plain"]["local"] for rank in (0, 1)]
    assert local[0] != local[1]  # each rank trained on its own data, without averaging
    for rank in (0, 1):
        averaged = found[rank]["plain"]["averaged"]
        for epoch, logs in enumerate(averaged):
            for name, value in logs.items():
                assert value == pytest.approx((local[0][epoch][name] + local[1][epoch][name]) / 2, rel=1e-6), name
    assert found[0]["plain"]["averaged"] == found[1]["plain"]["averaged"]


def test_batchnorm_statistics_are_averaged_at_each_epochs_end():
    found = shared("gloo", "batchnorm_stats")
    r0, r1 = found[0], found[1]
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    for epoch in range(2):
        local = [np.concatenate([np.ravel(v) for v in r["before"][epoch]]) for r in (r0, r1)]
        assert np.max(np.abs(local[0] - local[1])) > 1e-3  # each rank's own batches: apart before the average
        averaged = [np.concatenate([np.ravel(v) for v in r["after"][epoch]]) for r in (r0, r1)]
        np.testing.assert_array_equal(averaged[0], averaged[1])  # the same model on every rank
        np.testing.assert_allclose(averaged[0], (local[0] + local[1]) / 2, rtol=1e-6)  # their mean
    assert r0["default"] == r1["default"]  # BoostModel.fit averages them by itself


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_the_examples_verbose_1_prints_whole_readable_lines_under_horovodrun(controller):
    """verbose=1 on rank 0, as Horovod's example passes it: whole lines (Keras' bar redrew one line of 60,000
    characters an epoch, under MPI with the rank prefix glued into its middle), from rank 0 alone."""
    shared(controller, "horovod_example")
    lines = shared_output(controller, "horovod_example")
    assert max(len(line) for line in lines) <= 200, max(lines, key=len)
    assert not any("\r" in line or "\b" in line for line in lines)
    progress = [line for line in lines if "Epoch " in line and "loss: " in line]
    epochs = [line for line in progress if "ms/step" in line]
    assert len(epochs) == 4, progress  # one closing line per epoch, from rank 0 alone
    assert all(("[0]" in line or "[1,0]" in line) for line in epochs), epochs
