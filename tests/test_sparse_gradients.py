"""An `Embedding`'s gradient (`tf.IndexedSlices`) through the boost step's stages.

Keras' text models (keras-io's text classification, transformers) train `Embedding`
tables, whose gradients are `tf.IndexedSlices`: rows of values and their row indices,
repeated rows to be added. The stages that read or scale gradients take them as they are
(the values), and gradient centralization makes them dense the way the keras-io recipe
does (`grad - mean(grad)` moves every row). References: NumPy, and Keras' own step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import BoostModel
from keras_boost.core.contract import all_finite
from keras_boost.stages.centralization import GradientCentralization, centralize, column_sums
from keras_boost.stages.loss_scale import FixedLossScale
from keras_boost.optimizers import CentralizedOptimizer

VOCABULARY, DIM, LENGTH = 40, 16, 6


def _text_net(model_class, seed=7):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCABULARY, DIM, name="embedding")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return model_class(inputs, keras.layers.Dense(3, name="head")(h))


def _text_data(n=24, seed=8):
    rng = np.random.default_rng(seed)
    # Tokens 0-9 only, several per row: the table's gradient has repeated rows and untouched rows.
    return rng.integers(0, 10, (n, LENGTH)).astype(np.int32), rng.integers(0, 3, n)


def _sparse(seed=0, rows=(1, 3, 3, 7), dim=DIM, vocabulary=VOCABULARY):
    rng = np.random.default_rng(seed)
    values = rng.normal(2.0, 1.0, (len(rows), dim)).astype(np.float32)
    return tf.IndexedSlices(tf.constant(values), tf.constant(rows, tf.int64), tf.constant([vocabulary, dim], tf.int64))


def _dense_numpy(grad):
    dense = np.zeros(tuple(grad.dense_shape.numpy()), np.float32)
    np.add.at(dense, grad.indices.numpy(), grad.values.numpy())  # repeated rows added
    return dense


def _reference_gradients(x, y):
    model = _text_net(keras.Model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)  # the table's gradient is sparse: what this file is about
    return {v.path: (_dense_numpy(g) if isinstance(g, tf.IndexedSlices) else g.numpy())
            for v, g in zip(model.trainable_variables, grads)}


def test_column_sums_and_centralize_of_a_sparse_gradient_match_numpy():
    grad = _sparse()
    dense = _dense_numpy(grad)
    np.testing.assert_allclose(column_sums(grad).numpy(), dense.sum(axis=0, keepdims=True), rtol=1e-6)
    expected = dense - dense.mean(axis=0, keepdims=True)
    for sums in (None, column_sums(grad)):
        out = centralize(grad, sums, shape=(VOCABULARY, DIM))
        assert isinstance(out, tf.Tensor) and out.shape == (VOCABULARY, DIM)
        np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-6)


def test_centralize_of_a_sparse_gradient_of_unknown_shape_says_what_it_needs():
    @tf.function(input_signature=[tf.TensorSpec([None, DIM]), tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([2], tf.int64)])
    def run(values, indices, dense_shape):
        return centralize(tf.IndexedSlices(values, indices, dense_shape))

    grad = _sparse()
    with pytest.raises(ValueError, match="needs `shape`"):
        run(grad.values, grad.indices, grad.dense_shape)


@pytest.mark.parametrize("nan_guard", [True, False])
def test_gc_all_centralizes_an_embedding_table_like_the_keras_io_recipe(nan_guard):
    """One SGD step with gradient_centralization="all": every kernel of rank 2, the
    Embedding table included, moves by -lr * (g - mean(g)) from NumPy's centring of
    Keras' dense gradient (with the NaN guard the centring uses the sums of the values)."""
    x, y = _text_data()
    grads = _reference_gradients(x, y)
    model = _text_net(BoostModel)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  gradient_centralization="all", nan_guard=nan_guard)
    before = {v.path: np.array(v) for v in model.trainable_variables}
    model.train_on_batch(x, y)
    for variable in model.trainable_variables:
        g = grads[variable.path]
        if g.ndim >= 2:
            assert np.abs(g.mean(axis=0)).max() > 1e-4  # the centring changes something
            g = g - g.mean(axis=0, keepdims=True)
        np.testing.assert_allclose(np.array(variable), before[variable.path] - 0.5 * g, rtol=0, atol=1e-6,
                                   err_msg=variable.path)
    untouched = np.setdiff1d(np.arange(VOCABULARY), x)
    assert untouched.size and np.abs(np.array(model.trainable_variables[0])[untouched]
                                     - before["embedding/embeddings"][untouched]).min() > 0  # every row moved


def test_the_centralization_optimizer_wrapper_takes_a_sparse_gradient():
    x, y = _text_data()
    grads = _reference_gradients(x, y)
    model = _text_net(keras.Model)
    model.compile(optimizer=CentralizedOptimizer(keras.optimizers.SGD(0.5),
                                                    GradientCentralization(["embedding/embeddings"], 1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = np.array(model.trainable_variables[0])
    model.train_on_batch(x, y)
    g = grads["embedding/embeddings"]
    np.testing.assert_allclose(np.array(model.trainable_variables[0]),
                               before - 0.5 * (g - g.mean(axis=0, keepdims=True)), rtol=0, atol=1e-6)


def test_the_finite_check_reads_a_sparse_gradients_values_without_making_it_dense():
    grad = _sparse()
    assert bool(all_finite([grad, tf.ones((3, 3))]))
    for value in (np.nan, np.inf, -np.inf):
        values = grad.values.numpy().copy()
        values[2, 5] = value
        assert not bool(all_finite([tf.IndexedSlices(tf.constant(values), grad.indices, grad.dense_shape)]))
    graph = tf.function(lambda v, i: all_finite([tf.IndexedSlices(v, i, grad.dense_shape)])).get_concrete_function(
        tf.TensorSpec([None, DIM]), tf.TensorSpec([None], tf.int64)).graph
    assert not [op.type for op in graph.get_operations() if "Segment" in op.type or "Scatter" in op.type]


def test_loss_scale_unscales_a_sparse_gradient_and_keeps_it_sparse():
    grad = _sparse()
    stage = FixedLossScale(1024.0)
    stage.scale = tf.constant(1024.0)  # what `build` puts in the step's state
    (out,) = stage.unscale([grad])
    assert isinstance(out, tf.IndexedSlices)
    np.testing.assert_array_equal(out.values.numpy(), grad.values.numpy() / 1024.0)  # a power of 2: exact
    np.testing.assert_array_equal(out.indices.numpy(), grad.indices.numpy())


@pytest.mark.parametrize("boost", [{}, {"loss_scale": 1024.0}, {"loss_scale": "dynamic"}])
def test_an_embedding_model_trains_like_keras_model(boost):
    """Three SGD-momentum steps at O0 (with a power-of-2 loss scale, fixed or dynamic: exact
    in float32) equal keras.Model's within float32 rounding (the two steps are different graphs)."""
    x, y = _text_data(n=96)
    weights = []
    for model_class, options in ((keras.Model, {}), (BoostModel, boost)):
        model = _text_net(model_class)
        model.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **options)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        weights.append([np.array(v) for v in model.trainable_variables])
    moved = max(np.abs(a - b).max() for a, b in zip(weights[0], [np.array(v) for v in
                                                                  _text_net(keras.Model).trainable_variables]))
    assert moved > 1e-3
    for a, b in zip(*weights):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
