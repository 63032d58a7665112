"""The fused update: Keras' SGD/Adam/AdamW update through TensorFlow's fused kernels.

Against Keras' own update (the reference): the same optimizer object, the same gradients,
with and without `fused_kernels`. The kernels compute the same formula in one pass, so the
results agree up to float rounding, not bit for bit in general: one kernel instead of
several ops lets the compiler order (and contract into fused multiply-adds) the
multiplications differently, and how it does depends on the CPU. The tolerances below are a
few float32 ulps of the values (SGD) and of Adam's step (whose `1 - beta` is rounded in
float32 by the kernel, in float64 by Keras).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_boost
from keras_boost.config import BoostConfig
from keras_boost.stages.fused_update import FusedUpdate, fused_kernels, why_not_fused
from keras_boost.step import registry
from tests.helpers import classification_data, compile_sgd, mlp, weights

SHAPES = [(3, 3, 4, 8), (8,), (16, 5)]
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "schedule+clipnorm": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5), momentum=0.9, clipnorm=1.0),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
}


def _train(make, fused, graph, steps=5):
    rng = np.random.default_rng(3)
    variables = [keras.Variable(rng.standard_normal(s).astype("float32")) for s in SHAPES]
    grads = [[tf.constant(rng.standard_normal(s).astype("float32")) for s in SHAPES] for _ in range(steps)]
    optimizer = make()
    optimizer.build(variables)

    def step(g):
        if fused:
            with fused_kernels(optimizer):
                optimizer.apply(g, variables)
        else:
            optimizer.apply(g, variables)

    run = tf.function(step) if graph else step
    for g in grads:
        run(g)
    assert "update_step" not in vars(optimizer)  # Keras' own optimizer again afterwards
    return [v.numpy() for v in variables], [np.array(v) for v in optimizer.variables]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_kernels_give_keras_update(name, graph):
    expected, expected_slots = _train(OPTIMIZERS[name], fused=False, graph=graph)
    got, got_slots = _train(OPTIMIZERS[name], fused=True, graph=graph)
    # SGD: a few ulps of the values (|w| ~ 1); Adam: its steps are ~1e-2, rounded differently (module docstring).
    atol = 4e-6 if name.startswith("adam") else 1e-6  # measured: Adam 8e-7 after 5 steps, SGD 0 on one CPU
    for e, g in zip(expected + expected_slots, got + got_slots):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=atol)
    moved = max(float(np.max(np.abs(e - s))) for e, s in zip(expected, _train(OPTIMIZERS[name], False, graph, 0)[0]))
    assert moved > 1e-3  # the update did something the comparison could miss


def test_momentum_kernel_against_numpy():
    """An independent reference: m = 0.9 m - 0.1 g; w += m, in float64."""
    rng = np.random.default_rng(3)
    start = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(5)]
    w, m = [x.copy() for x in start], [np.zeros(s) for s in SHAPES]
    for g in grads:
        m = [0.9 * mi - 0.1 * gi for mi, gi in zip(m, g)]
        w = [wi + mi for wi, mi in zip(w, m)]
    got, _ = _train(OPTIMIZERS["momentum"], fused=True, graph=True)
    for e, g in zip(w, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)  # float32 against float64


def _apply_ops(model, x, y):
    """Op types of the boost step's graph, with every function it calls."""
    data = (tf.constant(x[:16]), tf.constant(y[:16]))
    concrete = tf.function(lambda: model.train_step(data)).get_concrete_function()
    graph_def = concrete.graph.as_graph_def()
    ops = [n.op for n in graph_def.node]
    for function in graph_def.library.function:
        ops += [n.op for n in function.node_def]
    return ops


def test_the_step_updates_with_one_kernel_per_variable():
    x, y = classification_data()
    fused = compile_sgd(mlp(), fused_update=True)
    plain = compile_sgd(mlp())
    for model in (fused, plain):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # builds everything
    ops = _apply_ops(fused, x, y)
    assert ops.count("ResourceApplyKerasMomentum") == len(fused.trainable_variables) == 4
    assert "ResourceApplyKerasMomentum" not in _apply_ops(plain, x, y)
    assert "update_step" not in vars(fused.optimizer)


@pytest.mark.parametrize("mode", ["graph", "jit_compile", "run_eagerly"])
def test_fit_with_kernels_trains_as_keras_update(mode):
    x, y = classification_data()
    options = {mode: True} if mode != "graph" else {}
    fused = compile_sgd(mlp(), fused_update=True, **options)
    plain = compile_sgd(mlp(), **options)
    for model in (fused, plain):
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for e, g in zip(weights(plain), weights(fused)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)  # 8 updates, a few ulps each (module docstring)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(weights(plain), weights(mlp()))) > 1e-2


def test_sparse_gradients_keep_keras_update():
    keras.utils.set_random_seed(0)
    variable = keras.Variable(np.random.default_rng(0).standard_normal((10, 4)).astype("float32"))
    grad = tf.IndexedSlices(tf.ones((2, 4)), tf.constant([1, 7]), tf.constant([10, 4]))
    results = []
    for fused in (False, True):
        v = keras.Variable(variable.numpy())
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build([v])
        with fused_kernels(optimizer) if fused else contextlib.nullcontext():
            optimizer.apply([grad], [v])
        results.append(v.numpy())
    np.testing.assert_array_equal(results[1], results[0])
    assert not np.array_equal(results[0], variable.numpy())


def test_optimizer_is_restored_when_the_update_raises():
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="inside"):
        with fused_kernels(optimizer):
            assert "update_step" in vars(optimizer)
            raise RuntimeError("inside")
    assert "update_step" not in vars(optimizer)


def test_optimizer_adapters_are_fused_through_their_inner_optimizer():
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    wrapped = keras_boost.optimizers.CentralizedOptimizer(inner)
    assert why_not_fused(wrapped) is None
    with fused_kernels(wrapped):
        assert "update_step" in vars(inner)
    assert "update_step" not in vars(inner)


@pytest.mark.parametrize("optimizer, reason", [
    (keras.optimizers.RMSprop(), "RMSprop's update has no fused kernel"),
    (keras.optimizers.Adam(amsgrad=True), "amsgrad=True"),
])
def test_optimizers_without_kernel_say_why(optimizer, reason):
    assert reason in why_not_fused(optimizer)


def test_explicit_option_with_an_optimizer_without_kernel_is_a_value_error_at_compile():
    model = mlp()
    with pytest.raises(ValueError, match="`fused_update=True`, but RMSprop's update has no fused kernel"):
        model.compile(optimizer=keras.optimizers.RMSprop(), loss="mse", fused_update=True)
    with pytest.raises(TypeError, match="`fused_update` must be None, a bool or a FusedUpdate, got 'yes'"):
        mlp().compile(optimizer="sgd", loss="mse", fused_update="yes")


def test_level_with_an_optimizer_without_kernel_warns_and_keeps_keras_update():
    x, y = classification_data()
    base = mlp(model_class=keras.Model)
    model = keras_boost.BoostModel(base.inputs, base.outputs, boost_level="O1",
                                   boost_config={"boost": {"mode": "manual", "grad_freeze": False, "less_bn": False,
                                                           "grad_accumulation": True}})
    with pytest.warns(UserWarning, match="the boost level's fused update is off: RMSprop's update"):
        model.compile(optimizer=keras.optimizers.RMSprop(0.01), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert "ResourceApplyKerasMomentum" not in _apply_ops(model, x, y)


@pytest.mark.parametrize("level, boost, on", [
    ("O0", {}, False),
    ("O1", {}, True),
    ("O2", {}, True),
    ("O1", {"fused_update": False}, False),
    ("O1", {"mode": "disable_all"}, False),
    ("O0", {"mode": "manual", "grad_accumulation": True}, True),
    ("O0", {"fused_update": True}, True),
])
def test_levels_switch_it_on_where_a_feature_is_on(level, boost, on):
    options = registry.level_options(BoostConfig(level, {"boost": boost}))
    assert isinstance(options.get("fused_update"), FusedUpdate) is on
    if on:
        assert options["fused_update"].strict is False  # a level's: warns, never fails, on other optimizers


def test_config_value_must_be_a_bool():
    with pytest.raises(TypeError, match=r"boost_config\['boost'\]\['fused_update'\]` must be a bool"):
        BoostConfig("O1", {"boost": {"fused_update": "yes"}})


def test_o1_trains_the_same_with_and_without_kernels():
    """A whole O1 fit (LessBN, FN head, GC, freezing) with the level's kernels against Keras' update."""
    from keras_boost.app.demo_net import demo_resnet

    rng = np.random.default_rng(0)
    x = rng.random((192, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 192)
    results = []
    for fused in (True, False):
        keras.utils.set_random_seed(0)
        base = demo_resnet(model_class=keras.Model)
        model = keras_boost.BoostModel(base.inputs, base.outputs, boost_level="O1",
                                       boost_config={"boost": {"fused_update": fused, "measure": False}})
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        assert (model.boost_step.stage("fused_update") is not None) is fused
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        results.append(weights(model))
    for a, b in zip(*results):
        # 12 updates through a ResNet: rounding differences grow through the forward pass; this bound is
        # ~1e-3 of the weights' movement, far below a wrong update (a lost momentum term moves them by ~1e-1).
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
