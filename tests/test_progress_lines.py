"""verbose=1 where no terminal reads it (a launcher's pipe or pty, a file): whole lines, at a readable rate."""

import keras
import numpy as np

import keras_boost
from keras_boost.fit.dropin import LineProgressLogger


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def logger(**kwargs):
    clock, lines = Clock(), []
    progress = LineProgressLogger(clock=clock, write=lines.append, **kwargs)
    return progress, clock, lines


def test_one_line_every_interval_and_one_at_each_epochs_end():
    progress, clock, lines = logger(hidden={"loss_scale"}, interval=10)
    progress.set_params({"epochs": 2, "steps": 100, "verbose": 1})
    progress.on_train_begin()
    for epoch in range(2):
        progress.on_epoch_begin(epoch)
        for batch in range(100):
            clock.now += 0.25  # 25 s an epoch: lines at 10 s and 20 s, then the epoch's
            progress.on_train_batch_end(batch, {"loss": 0.5, "accuracy": 0.75, "loss_scale": 1024.0})
        progress.on_epoch_end(epoch, {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.6, "loss_scale": 1024.0})
    progress.on_train_end()
    assert len(lines) == 6, lines
    assert lines[0] == "Epoch 1/2 40/100 - 10s - loss: 0.5 - accuracy: 0.75"
    assert lines[2] == "Epoch 1/2 100/100 - 25s - 250ms/step - loss: 0.5 - accuracy: 0.75 - val_loss: 0.6"
    assert lines[5].startswith("Epoch 2/2 100/100 - 25s")
    assert not any("loss_scale" in line for line in lines)  # the boost scalars stay out, as from the bar


def test_fits_validation_adds_no_evaluate_lines_and_evaluate_alone_has_its_own():
    progress, clock, lines = logger(interval=10)
    progress.set_params({"epochs": 1, "steps": 2, "verbose": 1})
    progress.on_train_begin()
    progress.on_epoch_begin(0)
    progress.on_test_begin()
    progress.on_test_batch_end(0, {"loss": 1.0})
    progress.on_test_end({"loss": 1.0})
    progress.on_epoch_end(0, {"loss": 1.0})
    progress.on_train_end()
    assert len(lines) == 1 and lines[0].startswith("Epoch 1/1 2/2")
    progress.set_params({"steps": 5, "verbose": 1})
    progress.on_test_begin()
    clock.now += 1
    progress.on_test_end({"loss": 2.0})
    assert lines[1] == "Evaluate 5/5 - 1s - 200ms/step - loss: 2"


def test_no_line_is_longer_than_the_width():
    progress, clock, lines = logger(interval=0, width=80)
    progress.set_params({"epochs": 1, "steps": None, "verbose": 1})
    progress.on_train_begin()
    progress.on_epoch_begin(0)
    many = {f"metric_number_{i}": float(i) for i in range(20)}
    progress.on_train_batch_end(0, many)
    progress.on_epoch_end(0, many)
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("Epoch 1/1 1 - 0s - metric_number_0: 0") and "more)" in lines[0]
    assert lines[1].startswith("Epoch 1/1 1/1 - 0s")  # unknown length: the batches seen


def test_fit_with_verbose_1_into_a_pipe_prints_whole_lines(capfd):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras_boost.BoostModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    model.fit(x, x[:, :2], batch_size=8, epochs=2, verbose=1)
    out = capfd.readouterr().out  # pytest's capture: not a terminal
    assert "\r" not in out and "\b" not in out
    epoch_lines = [line for line in out.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" - ")[0] for line in epoch_lines] == ["Epoch 1/2 8/8", "Epoch 2/2 8/8"], out
