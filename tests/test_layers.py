"""FNHead: the math against NumPy, construction from a Dense, validation, saving."""

import keras
import numpy as np
import pytest

from keras_boost.graph.layers import FNHead


def _numpy_fn(x, kernel, multiplier):
    def normalize(v, axis):
        return v / np.sqrt(np.maximum(np.sum(v * v, axis=axis, keepdims=True), 1e-4))

    return multiplier * normalize(x, 1) @ normalize(kernel, 0)


def test_logits_are_scaled_cosines_as_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 6)).astype(np.float32)
    x[1] = 0.0  # the epsilon keeps a zero row finite
    x[2] *= 1e-3  # below the epsilon: divided by 1e-2, not by its own norm
    kernel = rng.normal(size=(6, 3)).astype(np.float32)
    kernel[:, 1] *= 1e-3
    head = FNHead(3)
    head.build((None, 6))
    head.kernel.assign(kernel)
    head.multiplier.assign(2.5)
    np.testing.assert_allclose(head(x), _numpy_fn(x, kernel, 2.5), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(head(x))[1] == 0.0)


def test_weights_are_kernel_and_unit_multiplier_without_bias():
    head = FNHead(4, name="head")
    head.build((None, 7))
    assert [v.path for v in head.weights] == ["head/kernel", "head/multiplier"]
    assert tuple(head.kernel.shape) == (7, 4)
    assert float(head.multiplier) == 1.0
    assert all(v.trainable for v in head.weights)


def test_from_dense_copies_kernel_name_and_drops_bias():
    dense = keras.layers.Dense(3, name="predictions")
    dense.build((None, 5))
    dense.bias.assign(np.ones(3))
    head = FNHead.from_dense(dense)
    assert head.name == "predictions"
    assert np.array_equal(head.kernel.numpy(), dense.kernel.numpy())
    assert [v.path for v in head.weights] == ["predictions/kernel", "predictions/multiplier"]


def test_from_dense_rejects_non_dense_and_unbuilt():
    with pytest.raises(TypeError, match="keras.layers.Dense"):
        FNHead.from_dense(keras.layers.Conv2D(3, 1))
    with pytest.raises(ValueError, match="must be built"):
        FNHead.from_dense(keras.layers.Dense(3))


@pytest.mark.parametrize("units, error", [(0, ValueError), (-2, ValueError), ("3", TypeError),
                                          (True, TypeError), (2.0, TypeError)])
def test_units_validation(units, error):
    with pytest.raises(error, match="`units` must be a positive int"):
        FNHead(units)


def test_unknown_input_dimension_is_rejected():
    with pytest.raises(ValueError, match="known last input dimension"):
        FNHead(2).build((None, None))


def test_config_round_trip():
    head = FNHead(5, kernel_initializer="he_normal", name="fn")
    config = head.get_config()
    assert config["units"] == 5
    assert FNHead.from_config(config).get_config() == config


def test_keras_file_round_trip_gives_identical_outputs(tmp_path):
    inputs = keras.Input((8,))
    outputs = FNHead(4, name="fn")(keras.layers.Dense(6)(inputs))
    model = keras.Model(inputs, outputs)
    model.get_layer("fn").multiplier.assign(3.0)
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    path = tmp_path / "fn.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.get_layer("fn"), FNHead)
    assert float(loaded.get_layer("fn").multiplier) == 3.0
    assert np.array_equal(loaded(x), model(x))


def test_mixed_precision_norms_do_not_overflow():
    keras.config.set_dtype_policy("mixed_float16")
    head = FNHead(3)
    x = np.full((2, 64), 1000.0, np.float32)  # squared norm 6.4e7 overflows float16
    logits = head(x)
    keras.config.set_dtype_policy("float32")
    assert logits.dtype == "float16"
    expected = _numpy_fn(x, head.kernel.numpy(), 1.0)
    np.testing.assert_allclose(np.asarray(logits, np.float32), expected, atol=2e-3)
