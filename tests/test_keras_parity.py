"""fit/evaluate behaviours of Keras' own trainer tests, on keras.Model and on BoostModel.

Ported from keras/src/trainers/trainer_test.py (the behaviour, not the code): each case
runs once with `keras.Model` and once with `BoostModel` (no boost option) from the same
seed and data, and the results (history, weights, evaluate, predict) must be equal.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import BoostModel
from keras_boost.app.step_ops import op_counts


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(6, 3)), axis=1).astype(np.int32)
    return x, y


def _model(cls, seed=0):
    keras.utils.set_random_seed(seed)
    x_in = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="hidden")(x_in)
    return cls(x_in, keras.layers.Dense(3, name="out")(h))


def _compiled(cls, optimizer=None, **kwargs):
    model = _model(cls)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **kwargs)
    return model


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _fit(model, *args, **kwargs):
    kwargs.setdefault("verbose", 0)
    kwargs.setdefault("shuffle", False)
    return model.fit(*args, **kwargs).history


# ------------------------------------------------------------------------- behaviours
def sample_weight(cls):
    x, y = _data()
    w = np.linspace(0.1, 2.0, len(x)).astype(np.float32)
    model = _compiled(cls)
    history = _fit(model, x, y, sample_weight=w, batch_size=16, epochs=2)
    return {"history": history, "weights": _weights(model),
            "evaluate": model.evaluate(x, y, sample_weight=w, verbose=0, return_dict=True)}


def class_weight(cls):
    x, y = _data()
    model = _compiled(cls)
    history = _fit(model, x, y, class_weight={0: 0.5, 1: 2.0, 2: 1.0}, batch_size=16, epochs=2)
    return {"history": history, "weights": _weights(model)}


def validation_split(cls):
    x, y = _data()
    model = _compiled(cls)
    return {"history": _fit(model, x, y, validation_split=0.25, batch_size=16, epochs=2)}


def validation_data_and_freq(cls):
    x, y = _data()
    xv, yv = _data(32, seed=3)
    model = _compiled(cls)
    return {"history": _fit(model, x, y, validation_data=(xv, yv), validation_freq=2, batch_size=16, epochs=4)}


def steps_per_execution(cls):
    x, y = _data()
    model = _compiled(cls, steps_per_execution=3)
    history = _fit(model, x, y, batch_size=8, epochs=2)
    return {"history": history, "weights": _weights(model), "iterations": int(model.optimizer.iterations)}


def multi_output(cls):
    x, y = _data()
    keras.utils.set_random_seed(0)
    x_in = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(x_in)
    outputs = {"cls": keras.layers.Dense(3, name="cls")(h), "reg": keras.layers.Dense(1, name="reg")(h)}
    model = cls(x_in, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
                  loss_weights={"cls": 1.0, "reg": 0.5},
                  metrics={"cls": ["accuracy"], "reg": ["mae"]})
    targets = {"cls": y, "reg": x[:, :1] * 2.0}
    history = _fit(model, x, targets, batch_size=16, epochs=2)
    return {"history": history, "weights": _weights(model),
            "evaluate": model.evaluate(x, targets, verbose=0, return_dict=True)}


def early_stopping(cls):
    x, y = _data()
    model = _compiled(cls, optimizer=keras.optimizers.SGD(1e-6))  # nothing improves: stops early
    history = _fit(model, x, y, batch_size=16, epochs=10,
                   callbacks=[keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1.0)])
    return {"history": history, "epochs": len(history["loss"])}


def reduce_lr_on_plateau(cls):
    x, y = _data()
    model = _compiled(cls, optimizer=keras.optimizers.SGD(0.1))
    history = _fit(model, x, y, batch_size=16, epochs=4, callbacks=[
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0)])
    return {"history": history, "lr": float(np.array(model.optimizer.learning_rate))}


def tf_data_input(cls):
    x, y = _data()
    xv, yv = _data(32, seed=3)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(16)
    model = _compiled(cls)
    history = _fit(model, train, validation_data=val, epochs=2, steps_per_epoch=3)
    return {"history": history, "weights": _weights(model), "evaluate": model.evaluate(val, verbose=0)}


def keras_file_round_trip(cls, tmp_path):
    x, y = _data()
    model = _compiled(cls, optimizer=keras.optimizers.Adam(0.01))
    _fit(model, x, y, batch_size=16, epochs=1)
    path = tmp_path / f"{cls.__name__}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded).__name__ == type(model).__name__
    history = _fit(loaded, x, y, batch_size=16, epochs=1)  # optimizer state came back: same continuation
    _fit(model, x, y, batch_size=16, epochs=1)
    for a, b in zip(_weights(model), _weights(loaded)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    return {"history": history, "predict": loaded.predict(x, verbose=0)}


def initial_epoch_and_batch_methods(cls):
    x, y = _data()
    model = _compiled(cls)
    history = _fit(model, x, y, batch_size=16, epochs=3, initial_epoch=1)
    on_batch = model.train_on_batch(x[:16], y[:16], return_dict=True)
    return {"history": history, "train_on_batch": on_batch,
            "test_on_batch": model.test_on_batch(x[:16], y[:16], return_dict=True),
            "predict_on_batch": model.predict_on_batch(x[:4])}


def evaluate_and_predict(cls):
    x, y = _data()
    model = _compiled(cls)
    return {"evaluate": model.evaluate(x, y, batch_size=10, verbose=0),
            "evaluate_dict": model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True),
            "predict": model.predict(x, batch_size=10, verbose=0)}


def add_loss_and_regularizer(cls):
    x, y = _data()
    keras.utils.set_random_seed(0)
    x_in = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01))(x_in)
    model = cls(x_in, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = _fit(model, x, y, batch_size=16, epochs=2)
    return {"history": history, "weights": _weights(model)}


def stop_training_mid_epoch(cls):
    """A callback that sets `model.stop_training` at a batch: in one process fit stops right
    after that batch, as Keras' does (on several workers after the next update, tests/test_multiprocess.py)."""
    x, y = _data()

    class StopAtBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    model = _compiled(cls)
    history = _fit(model, x, y, batch_size=8, epochs=3, callbacks=[StopAtBatch()])
    return {"history": history, "weights": _weights(model), "iterations": int(model.optimizer.iterations.numpy()),
            "stopped": float(model.stop_training)}


def loss_scale_factor(cls):
    """An optimizer's `loss_scale_factor`: the step scales the loss, `apply` divides the gradients."""
    x, y = _data()
    model = _compiled(cls, keras.optimizers.SGD(0.1, momentum=0.9, loss_scale_factor=64.0))
    return {"history": _fit(model, x, y, batch_size=16, epochs=2), "weights": _weights(model)}


BEHAVIOURS = [sample_weight, class_weight, validation_split, validation_data_and_freq, steps_per_execution,
              multi_output, early_stopping, reduce_lr_on_plateau, tf_data_input, keras_file_round_trip,
              initial_epoch_and_batch_methods, evaluate_and_predict, add_loss_and_regularizer,
              stop_training_mid_epoch, loss_scale_factor]


def _assert_same(a, b, where="result"):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)) and not np.isscalar(a) and a and not isinstance(a[0], (int, float)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_same(u, v, f"{where}[{i}]")
    else:
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6,
                                   err_msg=where)


@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda f: f.__name__)
def test_boost_model_matches_keras_model(behaviour, tmp_path):
    kwargs = {"tmp_path": tmp_path} if behaviour is keras_file_round_trip else {}
    plain = behaviour(keras.Model, **kwargs)
    boosted = behaviour(BoostModel, **kwargs)
    _assert_same(plain, boosted)


def test_keras_loss_scale_optimizer_trains_as_in_keras_model():
    """Keras' LossScaleOptimizer: scaled loss in the step, overflow skips, the scale's halving and growth.

    An inf in one input of the second and fifth batches makes those steps overflow:
    LossScaleOptimizer skips them and halves the scale; after every 2 finite steps it doubles
    it. Until this was mended the boost step never scaled the loss, and `apply` divided
    unscaled gradients by the scale: the weights hardly moved.
    """
    x, y = _data(n=128)
    x[16, 0] = x[64, 0] = np.inf
    runs = {}
    for cls in (keras.Model, BoostModel):
        scales = []

        class Scale(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                scales.append(float(self.model.optimizer.dynamic_scale.numpy()))

        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10,
                                                        dynamic_growth_steps=2)
        model = _compiled(cls, optimizer)
        initial = _weights(model)
        history = _fit(model, x, y, batch_size=16, epochs=2, callbacks=[Scale()])
        runs[cls.__name__] = {"history": history, "weights": _weights(model), "scales": scales}
    plain, boosted = runs["Model"], runs["BoostModel"]
    scales = plain["scales"]
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    assert boosted["scales"] == scales
    _assert_same(plain, boosted)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(boosted["weights"], initial)) > 1e-2


def test_boost_model_step_runs_keras_models_ops():
    """Without a boost option the step is keras.Model's: the same ops, op type by op type.

    A convolutional model with BatchNormalization and SGD with momentum (the update's and the
    moving statistics' ops), so an op the boost step adds to every step (a copy of each
    gradient, a check, a counter) shows up as a difference.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=32).astype(np.int32)
    counts = {}
    for cls in (keras.Model, BoostModel):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
        h = keras.layers.BatchNormalization(name="bn")(h)
        h = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(h))
        model = cls(inputs, keras.layers.Dense(3, name="out")(h))
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # makes and traces model.train_function
        counts[cls.__name__] = op_counts(model)
    plain, boosted = counts["Model"], counts["BoostModel"]
    differences = {op: boosted[op] - plain[op] for op in set(plain) | set(boosted) if boosted[op] != plain[op]}
    assert not differences, f"BoostModel's step adds (+) or removes (-) ops against keras.Model's: {differences}"
