"""Gradient centralization: the variable selection, the math against NumPy, validation."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost.stages.centralization import GradientCentralization, gc_variables
from keras_boost.graph.layers import FNHead


def _zoo():
    """One layer of each kind gc_variables must select or leave out."""
    inputs = keras.Input((8, 8, 16))
    x = keras.layers.Conv2D(32, 3, padding="same", name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise")(x)
    x = keras.layers.Conv2D(32, 1, groups=4, name="grouped")(x)
    x = keras.layers.SeparableConv2D(16, 3, padding="same", name="separable")(x)
    x = keras.layers.Conv2DTranspose(16, 2, name="transposed")(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=16, bias_axes="c", name="einsum")(x)
    x = keras.layers.Dense(16, name="dense")(x)
    outputs = FNHead(4, name="fn")(x)
    return keras.Model(inputs, outputs)


def _random_grads(variables, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(3.0, 1.0, size=v.shape).astype(np.float32)) for v in variables]


def test_gc_variables_selects_plain_conv_pointwise_and_dense_kernels():
    paths = [v.path for v in gc_variables(_zoo())]
    assert paths == ["conv/kernel", "separable/pointwise_kernel", "einsum/kernel", "dense/kernel"]


def test_gc_variables_searches_nested_models():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, name="inner_dense")],
                             name="inner")
    inputs = keras.Input((4,))
    outer = keras.Model(inputs, keras.layers.Dense(2, name="outer_dense")(inner(inputs)))
    assert [v.path for v in gc_variables(outer)] == ["inner/inner_dense/kernel", "outer_dense/kernel"]


def test_gc_variables_rejects_non_layers():
    with pytest.raises(TypeError, match="`model` must be a Keras layer or model, got str"):
        gc_variables("model")


def test_centralized_gradients_match_numpy_and_others_are_untouched():
    model = _zoo()
    stage = GradientCentralization(gc_variables(model))
    variables = model.trainable_variables
    grads = _random_grads(variables)
    out = stage.apply(grads, variables)
    for g, new, v in zip(grads, out, variables):
        g = g.numpy()
        if v.path in ("conv/kernel", "separable/pointwise_kernel", "einsum/kernel", "dense/kernel"):
            axes = tuple(range(g.ndim - 1))
            np.testing.assert_allclose(new, g - g.mean(axis=axes, keepdims=True), atol=1e-5)
            np.testing.assert_allclose(np.asarray(new).mean(axis=axes), 0.0, atol=1e-5)
        else:
            assert np.array_equal(new, g), v.path


def test_input_channel_rule_follows_mindspore_and_can_be_disabled():
    model = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Conv2D(16, 3, name="stem"),
                              keras.layers.Conv2D(8, 1, name="next")])
    variables = gc_variables(model)
    grads = _random_grads(variables)
    default = GradientCentralization(variables).apply(grads, variables)
    assert np.array_equal(default[0], grads[0])  # 3 input channels: left alone, as in MindSpore
    assert not np.array_equal(default[1], grads[1])  # 16 input channels: centralised
    every = GradientCentralization(variables, min_channels_multiple=1).apply(grads, variables)
    assert not np.array_equal(every[0], grads[0])


def test_none_gradients_pass_through_and_tf_function_matches_eager():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    stage = GradientCentralization(gc_variables(model))
    variables = model.trainable_variables
    grads = _random_grads(variables)
    grads[1] = None
    eager = stage.apply(grads, variables)
    assert eager[1] is None
    traced = tf.function(lambda g0, g2, g3: stage.apply([g0, None, g2, g3], variables))(
        grads[0], grads[2], grads[3]
    )
    for a, b in zip(eager, traced):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("variables", ["kernel", None, [tf.ones((2, 2))], [1.0]])
def test_variables_must_be_a_list_of_keras_variables(variables):
    with pytest.raises(TypeError, match="`variables` must be a list or tuple of keras.Variable"):
        GradientCentralization(variables)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-16, ValueError), (16.0, TypeError),
                                          (True, TypeError), ("16", TypeError)])
def test_min_channels_multiple_validation(value, error):
    with pytest.raises(error, match="`min_channels_multiple` must be a positive int"):
        GradientCentralization([], min_channels_multiple=value)


def test_apply_rejects_lists_of_different_lengths():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16)])
    stage = GradientCentralization(gc_variables(model))
    with pytest.raises(ValueError, match="same length, got 1 gradients and 2 variables"):
        stage.apply([tf.ones((16, 16))], model.trainable_variables)


def test_the_boost_step_applies_centralized_gradients():
    """One plain-SGD step with gradient_centralization equals w - lr * (g - mean(g)) from a
    NumPy centring of the plain Keras gradient; the bias and the non-multiple kernel are not centred."""
    from keras_boost import BoostModel

    def net(model_class):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(16, activation="tanh", name="first")(inputs)  # input channels 6: left out
        return model_class(inputs, keras.layers.Dense(3, name="second")(h))  # input channels 16: centred

    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 3, 32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = net(keras.Model)
    with tf.GradientTape() as tape:
        value = loss(y, reference(x, training=True))
    grads = {v.path: g.numpy() for v, g in zip(reference.trainable_variables,
                                                tape.gradient(value, reference.trainable_variables))}
    model = net(BoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, gradient_centralization=True)
    before = {v.path: np.array(v) for v in model.trainable_variables}
    model.train_on_batch(x, y)
    assert [v.path for v in model.boost_step.stage("gradient_centralization").variables] == ["first/kernel", "second/kernel"]
    for variable in model.trainable_variables:
        g = grads[variable.path]
        if variable.path == "second/kernel":
            assert np.abs(g.mean(axis=0)).max() > 1e-3  # the centring changes something
            g = g - g.mean(axis=0, keepdims=True)
        np.testing.assert_allclose(np.array(variable), before[variable.path] - 0.5 * g, rtol=0, atol=1e-6)


def _conv_net(model_class):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", name="c1")(inputs)
    h = keras.layers.Conv2D(16, 3, padding="same", name="c2")(keras.layers.ReLU()(h))
    outputs = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling2D()(h))
    return model_class(inputs, outputs)


def _sums_reading(model, shapes):
    """The `Sum` ops of the traced step (outside the update's cond) whose input has one of `shapes`."""
    data = (tf.zeros((4, 8, 8, 3)), tf.zeros((4,), tf.int32))
    graph = tf.function(lambda: model.train_step(data)).get_concrete_function().graph
    return [op for op in graph.get_operations() if op.type == "Sum" and tuple(op.inputs[0].shape) in shapes]


@pytest.mark.parametrize("centralized", [True, False])
def test_the_finite_check_adds_the_centralization_sums_instead_of_reading_the_gradients_again(centralized):
    """With GC the NaN guard's check adds GC's per-channel sums: no full pass over a centralised gradient."""
    from keras_boost import BoostModel

    model = _conv_net(BoostModel)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  gradient_centralization="all" if centralized else None, nan_guard=True)
    model.build((None, 8, 8, 3))
    model.boost_step.build(model.boost_state)
    kernels = {tuple(v.shape) for v in model.trainable_variables if len(v.shape) >= 2}
    assert len(_sums_reading(model, kernels)) == (0 if centralized else 3)  # one per kernel without GC
    assert model.boost_step.stage("nan_guard") is not None


def test_finite_check_with_column_sums_sees_every_non_finite_value():
    from keras_boost.core.contract import all_finite

    model = _conv_net(keras.Model)
    stage = GradientCentralization.every_kernel()
    stage._select([v for v in model.trainable_variables if len(v.shape) >= 2])
    variables = model.trainable_variables
    grads = _random_grads(variables)
    assert bool(all_finite(grads, stage.column_sums(grads, variables)))
    for index, values in [(0, [np.inf]), (2, [np.nan]), (0, [np.inf, -np.inf]), (1, [-np.inf])]:  # 1: a bias
        bad = [g.numpy().copy() for g in grads]
        flat = bad[index].reshape(-1, bad[index].shape[-1])
        for row, value in enumerate(values):
            flat[row * 3, 5] = value  # inf and -inf in one channel: its sum is NaN
        bad = [tf.constant(b) for b in bad]
        sums = stage.column_sums(bad, variables)
        assert (sums[index] is None) == (index == 1)
        assert not bool(all_finite(bad, sums)), (index, values)


def test_nan_guard_with_centralization_stops_before_the_weights_are_touched():
    from keras_boost import BoostModel

    rng = np.random.default_rng(6)
    x, y = rng.random((48, 8, 8, 3)).astype(np.float32), rng.integers(0, 4, 48)
    x[40, 2, 2, 1] = np.nan  # third batch of 16
    model = _conv_net(BoostModel)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  gradient_centralization="all", nan_guard=True)
    seen = []
    with pytest.raises(FloatingPointError, match="non-finite gradient at batch 2"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: seen.append(
                      [np.array(w) for w in model.trainable_weights]))])
    for a, b in zip(seen[-1], model.trainable_weights):
        np.testing.assert_array_equal(a, np.array(b))  # the refused update left the weights as they were


def test_a_gradient_traced_without_its_batch_dimension_is_centralized():
    """keras-io's MLP-Mixer: a Dense on patches, and a partial last batch.

    Keras retraces the step with a batch dimension of None for the last, smaller batch, and
    the Dense kernel's gradient is then traced with the static shape `(None, 32)` (its
    variable's is `(8, 32)`). GC read the gradient's static shape and failed with a
    `TypeError` at `fit`; it now takes the variable's. The reference is keras.Model with an
    SGD whose `apply` centralises each kernel's gradient with `tf.reduce_mean` (the sums run in
    another order than GC's matmul, hence the float32 tolerance).
    """
    from keras_boost import BoostModel

    class CentredSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = [g - tf.reduce_mean(g, axis=list(range(len(g.shape) - 1)), keepdims=True) if len(g.shape) >= 2
                     else g for g in grads]
            return super().apply(grads, trainable_variables)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 16, 8)).astype(np.float32), rng.integers(0, 3, 50)
    trained = {}
    for cls, optimizer, options in ((BoostModel, keras.optimizers.SGD(0.1), {"gradient_centralization": "all"}),
                                    (keras.Model, CentredSGD(0.1), {})):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16, 8))
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(32, name="patches")(inputs))
        model = cls(inputs, keras.layers.Dense(3, name="out")(h))
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      **options)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # 16, 16, 16, then 2
        trained[cls.__name__] = model.get_weights()
    for a, b in zip(trained["BoostModel"], trained["Model"]):
        np.testing.assert_allclose(a, b, atol=1e-6)
