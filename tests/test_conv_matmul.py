"""One-pixel convolutions as matrix products (`keras_boost.stages.conv_matmul`).

References: Keras' own layer (the same layer object, the same inputs, with and without
`matmul_calls`), NumPy for which kernel taps meet the input, and keras.Model's `fit`. The
matrix product sums the same products as the convolution in another order (and oneDNN's
or Eigen's kernels in another order again, by CPU), so results agree up to float32
rounding, not bit for bit: the tolerances are relative to each tensor's largest value
(1e-5: ~100 float32 ulps; a wrong tap, a missing bias or a transposed kernel is off by
the values themselves). Where the stage leaves Keras' call in place, the results are
compared bit for bit: the same ops run.
"""

import itertools
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_boost
from keras_boost.config import BoostConfig
from keras_boost.stages.conv_matmul import ConvMatmul, matmul_calls, one_pixel_taps, why_not
from keras_boost.step import registry
from tests.helpers import compile_sgd, weights


def _close(got, expected, rel=1e-5):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=rel * max(1.0, float(np.max(np.abs(expected)))))


def _numpy_taps(n, k, s, d, padding):
    """(kernel index, input index) pairs of output position 0, from a padded input written out in NumPy; None unless
    the output is one position long."""
    if padding == "valid":
        before, out = 0, (n - (k - 1) * d - 1) // s + 1
    else:  # TensorFlow's "same": ceil(n / s) outputs, the padding split with the smaller half before
        out = -(-n // s)
        before = max((out - 1) * s + (k - 1) * d + 1 - n, 0) // 2
    if out != 1:
        return None
    padded = np.full(n + 2 * (k * d), -1)
    padded[before:before + n] = np.arange(n)  # each real position holds its index; padding holds -1
    return [(i, int(padded[i * d])) for i in range(k) if padded[i * d] >= 0]


def test_the_taps_of_a_one_pixel_output_against_numpy():
    checked = ones = 0
    for n, k, s, d, padding in itertools.product((1, 2, 3, 4, 5), (1, 2, 3, 5), (1, 2, 3), (1, 2), ("same", "valid")):
        if s > 1 and d > 1:
            continue  # Keras allows strides > 1 only with dilation 1
        expected = _numpy_taps(n, k, s, d, padding)
        assert one_pixel_taps((n,), (k,), (s,), (d,), padding) == (None if expected is None else [expected]), \
            (n, k, s, d, padding)
        checked, ones = checked + 1, ones + (expected is not None)
    assert checked == 160 and 0 < ones < checked
    assert one_pixel_taps((1, None), (3, 3), (1, 1), (1, 1), "same") is None  # unknown size: Keras' call


CASES = [  # (layer, input shape without the batch): every one gives a one-pixel output
    (lambda: keras.layers.Conv2D(6, 3, padding="same"), (1, 1, 5)),  # ResNet50's conv5 3x3: the centre tap
    (lambda: keras.layers.Conv2D(6, 1, strides=2), (2, 2, 5)),  # conv5_block1's 1x1, stride 2 on a 2x2 map
    (lambda: keras.layers.Conv2D(6, 3, activation="relu"), (3, 3, 5)),  # "valid" over the whole input: 9 taps
    (lambda: keras.layers.Conv2D(6, 3, strides=2, padding="same", use_bias=False), (2, 2, 5)),  # 4 taps
    (lambda: keras.layers.Conv2D(6, (3, 1), dilation_rate=2, padding="same"), (1, 1, 5)),
    (lambda: keras.layers.Conv3D(4, 3, padding="same"), (1, 1, 1, 5)),
    (lambda: keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2), (1, 1, 5)),
    (lambda: keras.layers.DepthwiseConv2D(3, strides=2, padding="same", activation="relu"), (2, 2, 5)),
    (lambda: keras.layers.DepthwiseConv1D(2, depth_multiplier=3), (2, 5)),
]


def _layer(make, shape):
    layer = make()
    layer.build((None, *shape))
    rng = np.random.default_rng(7)
    layer.set_weights([rng.normal(0, 1, w.shape).astype("float32") for w in layer.get_weights()])
    return layer


def _call(layer, x, matmul, graph=False):
    """(output, gradients of x and of each trainable variable) of one call, Keras' or the matrix product."""
    weights_ = np.cos(np.arange(int(np.prod(layer.compute_output_shape(x.shape))), dtype=np.float32))

    rewritten = set()

    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if matmul:
                with matmul_calls([layer], rewritten):
                    y = layer(x)
            else:
                y = layer(x)
            loss = tf.reduce_sum(tf.reshape(y, [-1]) * weights_)
        return y, tape.gradient(loss, [x] + [v.value for v in layer.trainable_variables])

    y, grads = (tf.function(run) if graph else run)(x)
    assert "call" not in vars(layer) and "convolution_op" not in vars(layer)  # Keras' own call again afterwards
    return np.asarray(y), [np.asarray(g) for g in grads], rewritten


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_matrix_product_gives_keras_convolution(case, graph):
    make, shape = CASES[case]
    layer = _layer(make, shape)
    assert why_not(layer) is None
    x = tf.constant(np.random.default_rng(case).normal(0, 1, (4, *shape)).astype("float32"))
    y, grads, rewritten = _call(layer, x, matmul=True, graph=graph)
    y_keras, grads_keras, _ = _call(layer, x, matmul=False, graph=graph)
    assert rewritten == {layer.name}
    _close(y, y_keras)
    for got, expected in zip(grads, grads_keras):
        _close(got, expected)
    kernel_grad, kernel_grad_keras = grads[1], grads_keras[1]
    # the taps that meet only padding: exactly zero from both
    assert np.array_equal(kernel_grad == 0, kernel_grad_keras == 0)


def test_a_call_whose_output_is_more_than_one_pixel_is_keras_own():
    layer = _layer(lambda: keras.layers.Conv2D(6, 3, padding="same"), (2, 2, 5))
    x = tf.constant(np.random.default_rng(0).normal(0, 1, (4, 2, 2, 5)).astype("float32"))
    (y, grads, rewritten), (y_keras, grads_keras, _) = _call(layer, x, True), _call(layer, x, False)
    assert rewritten == set()
    assert np.array_equal(y, y_keras) and all(np.array_equal(a, b) for a, b in zip(grads, grads_keras))


@pytest.mark.parametrize("make, reason", [
    (lambda: keras.layers.Conv2D(4, 3, padding="same", groups=2), "groups=2"),
    (lambda: keras.layers.Conv1D(4, 3, padding="same"), "Conv1D overrides call"),  # its own ops.conv call
    (lambda: type("MyConv", (keras.layers.Conv2D,), {"convolution_op": lambda self, x, k: x})(4, 3),
     "MyConv overrides convolution_op"),
    (lambda: type("MyDepthwise", (keras.layers.DepthwiseConv2D,), {"call": lambda self, x: x})(3),
     "MyDepthwise overrides call"),
])
def test_layers_the_rule_does_not_fit_keep_keras_call_and_say_why(make, reason):
    assert why_not(make()) == reason


def test_swap_is_reentrant_thread_safe_and_undone_on_errors():
    layer = _layer(lambda: keras.layers.Conv2D(6, 3, padding="same"), (1, 1, 5))
    with matmul_calls([layer]):
        with matmul_calls([layer]):
            pass
        assert "convolution_op" in vars(layer)  # the outer pass still holds it
    assert "convolution_op" not in vars(layer)
    with pytest.raises(RuntimeError):
        with matmul_calls([layer]):
            raise RuntimeError("in the forward pass")
    assert "convolution_op" not in vars(layer)
    barrier, errors = threading.Barrier(4), []

    def enter():
        try:
            for _ in range(50):
                barrier.wait(timeout=30)
                with matmul_calls([layer]):
                    assert "convolution_op" in vars(layer)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=enter) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and "convolution_op" not in vars(layer)


def _pixel_net(model_class=keras.Model):
    """A small network whose last convolutions have one-pixel outputs, as ResNet50's on 32x32 images."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 3))
    h = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(inputs)  # 2x2: Keras' own
    h = keras.layers.Conv2D(12, 1, strides=2)(h)  # 1x1
    h = keras.layers.Conv2D(12, 3, padding="same", activation="relu")(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same")(h)
    outputs = keras.layers.Dense(4)(keras.layers.Flatten()(h))
    return model_class(inputs, outputs)


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.random((n, 4, 4, 3), dtype=np.float32), rng.integers(0, 4, n)


def _step_graphs(model, x, y):
    """The op types of the boost step's graph and of each function it calls (at O1, a branch per freeze group)."""
    data = (tf.constant(x[:16]), tf.constant(y[:16]))
    graph_def = tf.function(lambda: model.train_step(data)).get_concrete_function().graph.as_graph_def()
    return [[n.op for n in graph_def.node]] + [[n.op for n in f.node_def] for f in graph_def.library.function]


@pytest.mark.parametrize("level, boost, compile_option, on", [
    ("O0", None, None, False),
    ("O0", None, True, True),
    ("O1", None, None, True),
    ("O1", {"boost": {"conv_matmul": False}}, None, False),
    ("O1", None, False, False),
])
def test_the_step_runs_one_pixel_convolutions_as_matrix_products(level, boost, compile_option, on):
    x, y = _data()
    base = _pixel_net()
    model = keras_boost.BoostModel(base.inputs, base.outputs, boost_level=level, boost_config=boost)
    compile_sgd(model, **({} if compile_option is None else {"conv_matmul": compile_option}))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    convs = [layer for layer in model._flatten_layers()
             if isinstance(layer, (keras.layers.Conv2D, keras.layers.DepthwiseConv2D))]
    assert all("call" not in vars(layer) and "convolution_op" not in vars(layer) for layer in convs)
    forward_passes = [ops for ops in _step_graphs(model, x, y) if "Conv2D" in ops]
    assert forward_passes
    for ops in forward_passes:
        if on:  # only the first convolution (a 2x2 output) stays one
            assert ops.count("Conv2D") == 1 and "DepthwiseConv2dNative" not in ops
        else:
            assert ops.count("Conv2D") == 3 and ops.count("DepthwiseConv2dNative") == 1
    if on:
        assert model.boost_step.stage("conv_matmul").rewritten == {layer.name for layer in convs[1:]}
    predict_ops = [n.op for n in tf.function(lambda: model(x[:4], training=True)).get_concrete_function()
                   .graph.as_graph_def().node]
    assert predict_ops.count("Conv2D") == 3  # outside the step, Keras' layers


@pytest.mark.parametrize("mode", ["graph", "jit_compile", "run_eagerly"])
def test_fit_with_matrix_products_trains_as_keras_model(mode):
    x, y = _data(96)
    keras_model = _pixel_net()
    compile_sgd(keras_model, lr=0.05, **({mode: True} if mode != "graph" else {}))
    keras_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _pixel_net(keras_boost.BoostModel)
    compile_sgd(model, lr=0.05, conv_matmul=True, **({mode: True} if mode != "graph" else {}))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert len(model.boost_step.stage("conv_matmul").rewritten) == 3
    for a, b in zip(weights(model), weights(keras_model)):
        # 12 updates: each call's rounding differences (module docstring) pass through the next updates;
        # the weights moved by more than 1e-2 (below)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    start = weights(_pixel_net())
    assert max(float(np.max(np.abs(a - s))) for a, s in zip(weights(model), start)) > 1e-2


def test_mixed_precision_keeps_the_layers_dtypes():
    x, y = _data()
    results = []
    for matmul in (True, False):
        keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
        try:
            model = _pixel_net(keras_boost.BoostModel)
        finally:
            keras.mixed_precision.set_dtype_policy("float32")
        compile_sgd(model, lr=0.05, conv_matmul=matmul)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        assert len(model.boost_step.stage("conv_matmul").rewritten if matmul else ()) == (3 if matmul else 0)
        results.append(weights(model))
    for a, b in zip(*results):  # bfloat16 products: 8 bits of mantissa, ~4e-3 relative per rounding
        np.testing.assert_allclose(a, b, rtol=0, atol=3e-2)


def test_saved_model_keeps_the_option():
    x, y = _data()
    model = _pixel_net(keras_boost.BoostModel)
    compile_sgd(model, conv_matmul=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = f"{__import__('tempfile').mkdtemp()}/m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.boost_step.stage("conv_matmul"), ConvMatmul)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(loaded.boost_step.stage("conv_matmul").rewritten) == 3


@pytest.mark.parametrize("level, boost, on", [
    ("O0", {}, False),
    ("O1", {}, True),
    ("O2", {}, True),
    ("O1", {"conv_matmul": False}, False),
    ("O1", {"mode": "disable_all"}, False),
    ("O0", {"conv_matmul": True}, True),
])
def test_levels_switch_it_on_where_a_feature_is_on(level, boost, on):
    options = registry.level_options(BoostConfig(level, {"boost": boost}))
    assert isinstance(options.get("conv_matmul"), ConvMatmul) is on


def test_bad_values_are_refused_naming_the_option():
    with pytest.raises(TypeError, match=r"boost_config\['boost'\]\['conv_matmul'\]` must be a bool"):
        BoostConfig("O1", {"boost": {"conv_matmul": 1}})
    with pytest.raises(TypeError, match="`conv_matmul` must be None, a bool or a ConvMatmul, got 'yes'"):
        _pixel_net(keras_boost.BoostModel).compile(optimizer="sgd", loss="mse", conv_matmul="yes")
