"""The fused BatchNorm: Keras' BatchNormalization trained through TensorFlow's FusedBatchNormV3.

References: Keras' own layer (the same layer object, the same inputs, with and without
`fused_calls`) and NumPy. The kernel sums the moments in another order than Keras' ops (and
oneDNN's kernel in another order than Eigen's, depending on the CPU), so results agree up to
float32 rounding, not bit for bit: the tolerances below are relative to each tensor's size
(1e-5 of its largest value: ~100 float32 ulps, far below any wrong formula, e.g. the
unbiased variance in the moving statistics, off by 1/n = 1e-2 here). Where the stage leaves
Keras' call in place, the results are compared bit for bit: the same ops run.
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_boost
from keras_boost.config import BoostConfig
from keras_boost.stages.fused_batchnorm import FusedBatchNorm, fused_calls, why_not_fused
from keras_boost.step import registry
from tests.helpers import compile_sgd, weights


def _close(got, expected, rel=1e-5):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=rel * max(1.0, float(np.max(np.abs(expected)))))


def _layer(shape, **options):
    layer = keras.layers.BatchNormalization(**options)
    layer.build(shape)
    rng = np.random.default_rng(7)
    layer.set_weights([rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in layer.get_weights()])
    return layer


def _train_call(layer, x, fused, graph=False):
    """(output, gradients of x, gamma and beta, moving statistics after) of one training call."""
    start = layer.get_weights()
    # a weight per value, not per channel: with one per channel gamma's gradient would be a sum of normalised values,
    # zero up to rounding, and the comparison would measure nothing but rounding
    weights_ = np.sin(np.arange(np.prod(x.shape), dtype=np.float32) + 1.0).reshape(x.shape)

    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if fused:
                with fused_calls([layer]):
                    y = layer(x, training=True)
            else:
                y = layer(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights_)
        return y, tape.gradient(loss, [x] + [v.value for v in layer.trainable_variables])

    y, grads = (tf.function(run) if graph else run)(x)
    result = (np.asarray(y), [np.asarray(g) for g in grads], [np.asarray(v) for v in layer.non_trainable_variables])
    layer.set_weights(start)
    assert "call" not in vars(layer)  # Keras' own call again afterwards
    return result


CASES = {
    "conv": ((8, 5, 5, 16), {}),
    "resnet": ((8, 5, 5, 16), {"epsilon": 1.001e-5, "momentum": 0.9}),  # keras.applications' BatchNorms
    "no-center": ((8, 5, 5, 16), {"center": False}),
    "no-scale": ((8, 5, 5, 16), {"scale": False}),
    "dense": ((32, 16), {}),
    "sequence": ((4, 7, 16), {}),
    "volume": ((2, 3, 4, 5, 16), {"axis": 4}),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_call_gives_keras_batchnorm(case, graph):
    shape, options = CASES[case]
    layer = _layer(shape, **options)
    x = tf.constant(np.random.default_rng(1).standard_normal(shape).astype("float32") * 3 + 1)
    expected = _train_call(layer, x, fused=False, graph=graph)
    got = _train_call(layer, x, fused=True, graph=graph)
    _close(got[0], expected[0])
    for g, e in zip(got[1], expected[1]):
        _close(g, e)
    for g, e, before in zip(got[2], expected[2], layer.non_trainable_variables):
        _close(g, e)
        assert np.max(np.abs(e - np.asarray(before))) > 1e-3  # the moving statistics did move


def test_fused_call_against_numpy():
    """An independent reference: normalised with the biased variance, moving statistics averaged with it too."""
    layer = _layer((6, 3, 3, 4), momentum=0.8, epsilon=1e-3)
    gamma, beta, moving_mean, moving_var = [w.astype(np.float64) for w in layer.get_weights()]
    x = np.random.default_rng(2).standard_normal((6, 3, 3, 4)) * 2 + 0.5
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))  # var: biased (ddof 0), as Keras
    y, _, (new_mean, new_var) = _train_call(layer, tf.constant(x.astype("float32")), fused=True)
    _close(y, (x - mean) / np.sqrt(var + 1e-3) * gamma + beta)
    _close(new_mean, moving_mean * 0.8 + mean * 0.2)
    _close(new_var, moving_var * 0.8 + var * 0.2)  # the unbiased variance (n/(n-1) = 54/53) would be 4e-3 off


def test_mixed_bfloat16_layer_keeps_keras_dtypes():
    layer = _layer((8, 4, 4, 16), dtype="mixed_bfloat16")
    x = tf.constant(np.random.default_rng(3).standard_normal((8, 4, 4, 16)), tf.bfloat16)
    expected, got = _train_call(layer, x, fused=False), _train_call(layer, x, fused=True)
    assert got[0].dtype == expected[0].dtype == tf.bfloat16.as_numpy_dtype
    _close(got[0].astype(np.float32), expected[0].astype(np.float32), rel=1e-2)  # bfloat16 outputs: 8 bits
    for g, e in zip(got[2], expected[2]):  # statistics in float32, from the same float32 inputs
        _close(g, e)


@pytest.mark.parametrize("options, reason", [
    ({"renorm": True}, "renorm=True"),
    ({"synchronized": True}, "synchronized=True"),
    ({"epsilon": 1e-6}, "epsilon=1e-06 is below"),
    ({"dtype": "float64"}, "its variables are float64"),
])
def test_layers_the_kernel_does_not_fit_say_why(options, reason):
    assert reason in why_not_fused(_layer((4, 3, 3, 8), **options))


def test_subclasses_overriding_call_keep_their_call():
    class Custom(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=training, mask=mask) * 2.0

    layer = Custom()
    layer.build((4, 3, 3, 8))
    assert why_not_fused(layer) == "Custom overrides call"


@pytest.mark.parametrize("case", ["inference", "frozen", "channels-first", "mask"])
def test_calls_the_kernel_does_not_fit_are_keras_own(case):
    """Bit for bit Keras' call: the swapped call hands these to it."""
    axis = 1 if case == "channels-first" else -1
    shape = (6, 8, 5) if case == "mask" else (4, 8, 3, 3)
    layer = _layer(shape, axis=axis)
    layer.trainable = case != "frozen"
    x = tf.constant(np.random.default_rng(4).standard_normal(shape).astype("float32"))
    kwargs = {"training": case != "inference"}
    if case == "mask":
        kwargs["mask"] = tf.constant(np.random.default_rng(5).random((6, 8)) > 0.3)
    start = layer.get_weights()
    expected = layer(x, **kwargs)
    after = layer.get_weights()
    layer.set_weights(start)
    with fused_calls([layer]):
        got = layer(x, **kwargs)
    np.testing.assert_array_equal(got, expected)
    for g, e in zip(layer.get_weights(), after):
        np.testing.assert_array_equal(g, e)


def test_swap_is_reentrant_thread_safe_and_undone_on_errors():
    layer = _layer((4, 3, 3, 8))
    with fused_calls([layer]):
        with fused_calls([layer]):
            assert "call" in vars(layer)
        assert "call" in vars(layer)  # still inside the outer forward pass
    assert "call" not in vars(layer)
    with pytest.raises(RuntimeError, match="inside"):
        with fused_calls([layer]):
            raise RuntimeError("inside")
    assert "call" not in vars(layer)
    inside, leave = threading.Event(), threading.Event()

    def other_forward():  # a freeze group traced ahead in the background
        with fused_calls([layer]):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other_forward)
    thread.start()
    inside.wait(10)
    with fused_calls([layer]):
        pass
    assert "call" in vars(layer)  # the other thread is still in its forward pass
    leave.set()
    thread.join(10)
    assert "call" not in vars(layer)


def _bn_net(model_class=keras.Model, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(16, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(16, 3, padding="same")(h)
    h = keras.layers.BatchNormalization(momentum=0.9, epsilon=1.001e-5)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(16)(h)
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(4)(h)
    return model_class(inputs, outputs)


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.random((n, 8, 8, 3), dtype=np.float32), rng.integers(0, 4, n)


def _step_ops(model, x, y):
    """Op types of the boost step's graph, with every function it calls."""
    data = (tf.constant(x[:16]), tf.constant(y[:16]))
    graph_def = tf.function(lambda: model.train_step(data)).get_concrete_function().graph.as_graph_def()
    return [n.op for n in graph_def.node] + [n.op for f in graph_def.library.function for n in f.node_def]


@pytest.mark.parametrize("level, boost, compile_option, fused", [
    ("O0", None, None, False),
    ("O0", None, True, True),
    ("O1", None, None, True),
    ("O1", {"boost": {"fused_batchnorm": False}}, None, False),
    ("O1", None, False, False),
])
def test_the_step_trains_each_batchnorm_with_one_kernel(level, boost, compile_option, fused):
    x, y = _data()
    base = _bn_net()
    model = keras_boost.BoostModel(base.inputs, base.outputs, boost_level=level, boost_config=boost)
    options = {} if compile_option is None else {"fused_batchnorm": compile_option}
    compile_sgd(model, **options)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    layers = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
    assert layers and all("call" not in vars(layer) for layer in layers)  # Keras' own call outside the step
    ops = _step_ops(model, x, y)  # at O1 one forward and backward pass per freeze group, inside a switch_case
    if fused:  # Keras' moments (a SquaredDifference each) are gone
        assert "SquaredDifference" not in ops and ops.count("FusedBatchNormV3") % len(layers) == 0
        assert ops.count("FusedBatchNormGradV3") >= len(layers)
    else:
        assert "FusedBatchNormV3" not in ops and ops.count("SquaredDifference") % len(layers) == 0
    if fused:
        assert model.boost_step.stage("fused_batchnorm").layers == layers
    predict_ops = [n.op for n in tf.function(lambda: model(x[:4], training=True)).get_concrete_function()
                   .graph.as_graph_def().node]
    assert "FusedBatchNormV3" not in predict_ops  # outside the step, Keras' layer


@pytest.mark.parametrize("mode", ["graph", "jit_compile", "run_eagerly"])
def test_fit_with_the_kernel_trains_as_keras_batchnorm(mode):
    x, y = _data(96)
    results = []
    for fused in (True, False):
        model = _bn_net(keras_boost.BoostModel)
        compile_sgd(model, lr=0.05, fused_batchnorm=fused, **({mode: True} if mode != "graph" else {}))
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append([np.asarray(w) for w in model.weights])
    for a, b in zip(*results):
        if mode == "jit_compile":  # XLA: Keras' call in both, one compiled program (module docstring)
            np.testing.assert_array_equal(a, b)
        else:
            # 12 updates: the rounding differences of each call (module docstring) pass through the next updates;
            # measured ~1e-6 here, while the weights moved by ~1e-1.
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    start = [np.asarray(w) for w in _bn_net().weights]
    assert max(float(np.max(np.abs(a - s))) for a, s in zip(results[1], start)) > 1e-2


def _offset_channels(n=16):
    """Channels of mean 3 and spreads 1, 1e-2 and 1e-3: a one-pass variance cancels in float32."""
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 5, 5, 3)) * np.array([1.0, 1e-2, 1e-3]) + 3).astype("float32")


def test_xla_computes_the_fused_kernels_variance_in_one_pass():
    """Why a step compiled by XLA keeps Keras' call: XLA's FusedBatchNormV3 loses the small variances."""
    x = _offset_channels()
    exact = x.astype(np.float64).reshape(-1, 3).var(0)
    empty = tf.constant([], tf.float32)

    def batch_variance(inputs):  # the kernel's fifth output: the biased batch variance
        return tf.raw_ops.FusedBatchNormV3(x=inputs, scale=tf.ones([3]), offset=tf.zeros([3]), mean=empty,
                                           variance=empty, epsilon=1e-5, exponential_avg_factor=1.0,
                                           data_format="NHWC", is_training=True)[4]

    kernel = batch_variance(tf.constant(x)).numpy()
    xla = tf.function(batch_variance, jit_compile=True)(tf.constant(x)).numpy()
    np.testing.assert_allclose(kernel, exact, rtol=1e-4)  # TensorFlow's kernel: two passes
    assert abs(xla[2] - exact[2]) > 0.5 * exact[2]  # XLA's: off by more than half (measured: negative)


def test_a_step_compiled_by_xla_keeps_keras_batchnorm_and_its_exact_moving_variance():
    x = _offset_channels(32)
    inputs = keras.Input((5, 5, 3))
    outputs = keras.layers.Dense(2)(keras.layers.Flatten()(
        keras.layers.BatchNormalization(momentum=0.0, epsilon=1.001e-5)(inputs)))
    model = keras_boost.BoostModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", fused_batchnorm=True, jit_compile=True)
    model.fit(x, np.zeros((32, 2), "float32"), batch_size=32, epochs=1, verbose=0)
    exact = x.astype(np.float64).reshape(-1, 3).var(0)  # momentum 0: the moving variance is the batch's
    np.testing.assert_allclose(np.asarray(model.layers[1].moving_variance), exact, rtol=1e-3)
    ops = _step_ops(model, x, np.zeros((32, 2), "float32"))
    assert "FusedBatchNormV3" not in ops and "SquaredDifference" in ops


def test_saved_model_keeps_the_option():
    x, y = _data()
    model = _bn_net(keras_boost.BoostModel)
    compile_sgd(model, fused_batchnorm=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = f"{__import__('tempfile').mkdtemp()}/m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.boost_step.stage("fused_batchnorm"), FusedBatchNorm)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(loaded.boost_step.stage("fused_batchnorm").layers) == 3
    assert [type(layer).__name__ for layer in loaded.layers] == [type(layer).__name__ for layer in model.layers]


@pytest.mark.parametrize("level, boost, on", [
    ("O0", {}, False),
    ("O1", {}, True),
    ("O2", {}, True),
    ("O1", {"fused_batchnorm": False}, False),
    ("O1", {"mode": "disable_all"}, False),
    ("O0", {"fused_batchnorm": True}, True),
])
def test_levels_switch_it_on_where_a_feature_is_on(level, boost, on):
    options = registry.level_options(BoostConfig(level, {"boost": boost}))
    assert isinstance(options.get("fused_batchnorm"), FusedBatchNorm) is on


def test_bad_values_are_refused_naming_the_option():
    with pytest.raises(TypeError, match=r"boost_config\['boost'\]\['fused_batchnorm'\]` must be a bool"):
        BoostConfig("O1", {"boost": {"fused_batchnorm": 1}})
    with pytest.raises(TypeError, match="`fused_batchnorm` must be None, a bool or a FusedBatchNorm, got 'yes'"):
        _bn_net(keras_boost.BoostModel).compile(optimizer="sgd", loss="mse", fused_batchnorm="yes")


def test_o1_trains_the_same_with_and_without_the_kernel():
    """An O1 update (LessBN, FN head, GC, freezing, the fused update) with the level's fused BatchNorm and without."""
    from keras_boost.app.demo_net import demo_resnet

    rng = np.random.default_rng(0)
    x = rng.random((32, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    results = []
    for fused in (True, False):
        keras.utils.set_random_seed(0)
        base = demo_resnet(model_class=keras.Model)
        model = keras_boost.BoostModel(base.inputs, base.outputs, boost_level="O1",
                                       boost_config={"boost": {"fused_batchnorm": fused, "measure": False}})
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        assert (model.boost_step.stage("fused_batchnorm") is not None) is fused
        if fused:
            assert len(model.boost_step.stage("fused_batchnorm").layers) == model.less_bn_report.num_kept > 0
        start = weights(model)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        results.append(weights(model))
    for a, b in zip(*results):
        # One update: on random labels with SGD(0.05, momentum 0.9) this ResNet amplifies any difference about
        # tenfold per update (stem kernel at O1: 3e-5 after one update, 5e-4 after two, with oneDNN off; 4e-6
        # after one with it on). The bound is 6x the larger; the weights moved by more than 1e-2.
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-4)
    assert max(float(np.max(np.abs(a - s))) for a, s in zip(results[1], start)) > 1e-2
