"""keras_boost's own kernel: gradient centralization inside Keras' SGD-momentum update.

`KerasBoostCentredKerasMomentum` computes, element by element, `g' = g - sums / n`,
`accum = accum * momentum - g' * lr`, `var += accum` (Nesterov: `var += accum * momentum -
g' * lr`). Each value is the same sequence of IEEE float operations as NumPy's, and the
library is built with `-ffp-contract=off` (no fused multiply-add), so it is compared with
NumPy bit for bit, on any CPU. Against TensorFlow's own two-op form (`centralize`, then
`ResourceApplyKerasMomentum`, whose compiled Eigen code may contract into fused
multiply-adds depending on the CPU) the comparison is within float32 rounding.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_boost
from keras_boost import kernels
from keras_boost.stages.centralization import centralize, column_sums
from keras_boost.stages.fused_update import centring_unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(3, 3, 16, 8), (64, 10), (1, 1, 32, 5), (2, 2, 3, 1)]


def test_setup_built_the_library_for_this_tensorflow():
    """scripts/setup.sh builds it (test.sh runs setup first): here it loads, built from these sources."""
    assert kernels.mode() == "auto"
    assert kernels.library() is not None, kernels.why_unavailable()
    assert kernels.why_unavailable() is None


def _numpy_update(var, accum, grad, lr, momentum, nesterov):
    dtype = var.dtype.type
    n = dtype(grad.size // grad.shape[-1])
    sums = np.ones((1, grad.size // grad.shape[-1]), var.dtype) @ grad.reshape(-1, grad.shape[-1])
    centred = grad - sums * (dtype(1) / n)  # as a compiled step computes `sums / n` (grappler: reciprocal)
    accum = accum * dtype(momentum) - centred.reshape(grad.shape) * dtype(lr)
    step = accum * dtype(momentum) - centred.reshape(grad.shape) * dtype(lr) if nesterov else accum
    return var + step, accum, sums


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_numpy_bit_for_bit(shape, nesterov, dtype):
    rng = np.random.default_rng(len(shape) + shape[-1])
    var0, accum0, grad = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    expected_var, expected_accum, sums = _numpy_update(var0, accum0, grad, 0.05, 0.9, nesterov)
    var, accum = tf.Variable(var0), tf.Variable(accum0)
    kernels.centred_keras_momentum(var.handle, accum.handle, tf.constant(0.05, dtype), tf.constant(grad),
                                   tf.constant(sums.reshape(-1)), tf.constant(0.9, dtype), nesterov=nesterov)
    np.testing.assert_array_equal(accum.numpy(), expected_accum)
    np.testing.assert_array_equal(var.numpy(), expected_var)


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_kernel_equals_centralize_then_tensorflows_momentum_kernel(nesterov):
    rng = np.random.default_rng(7)
    shape = (3, 3, 32, 16)
    var0, accum0, grad = (rng.standard_normal(shape).astype("float32") for _ in range(3))
    results = []
    for one_kernel in (True, False):
        var, accum = tf.Variable(var0), tf.Variable(accum0)
        g = tf.constant(grad)

        @tf.function
        def update():
            if one_kernel:
                kernels.centred_keras_momentum(var.handle, accum.handle, tf.constant(0.1), g,
                                               tf.reshape(column_sums(g), [-1]), tf.constant(0.9), nesterov=nesterov)
            else:
                tf.raw_ops.ResourceApplyKerasMomentum(var=var.handle, accum=accum.handle, lr=tf.constant(0.1),
                                                      grad=centralize(g), momentum=tf.constant(0.9),
                                                      use_nesterov=nesterov)

        for _ in range(3):
            update()
        results.append((var.numpy(), accum.numpy()))
    for a, b in zip(*results):
        # Same operations; TensorFlow's kernel may fuse a multiply-add (CPU-dependent): float32 rounding.
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_kernel_rejects_inconsistent_inputs():
    var, accum = tf.Variable(tf.zeros((4, 3))), tf.Variable(tf.zeros((4, 3)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="one value per output channel"):
        kernels.centred_keras_momentum(var.handle, accum.handle, tf.constant(0.1), tf.zeros((4, 3)),
                                       tf.zeros((4,)), tf.constant(0.9))
    with pytest.raises(tf.errors.InvalidArgumentError, match="must have one shape"):
        kernels.centred_keras_momentum(var.handle, accum.handle, tf.constant(0.1), tf.zeros((3, 4)),
                                       tf.zeros((4,)), tf.constant(0.9))
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 2 or more"):
        v1, a1 = tf.Variable(tf.zeros((3,))), tf.Variable(tf.zeros((3,)))
        kernels.centred_keras_momentum(v1.handle, a1.handle, tf.constant(0.1), tf.zeros((3,)), tf.zeros((3,)),
                                       tf.constant(0.9))


def test_environment_value_is_checked(monkeypatch):
    monkeypatch.setenv("KERAS_BOOST_NATIVE_KERNELS", "yes")
    with pytest.raises(ValueError, match=r"KERAS_BOOST_NATIVE_KERNELS='yes': use auto .* 0 .* or 1"):
        kernels.library()
    monkeypatch.setenv("KERAS_BOOST_NATIVE_KERNELS", "0")
    assert kernels.library() is None and kernels.why_unavailable() == "KERAS_BOOST_NATIVE_KERNELS=0"


def test_a_library_built_from_other_sources_is_not_loaded(tmp_path):
    """A stale stamp (other sources or another TensorFlow) leaves the library unloaded, and says why."""
    code = ("import keras_boost.kernels as k, unittest.mock as m\n"
            "with m.patch.object(k, 'stamp', lambda: 'other'):\n"
            "    print(k.library() is None, '|', k.why_unavailable())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    loaded_none, why = out.stdout.strip().split(" | ")
    assert loaded_none == "True" and "built for another TensorFlow or other sources" in why


# ------------------------------------------------------------------- in the boost step
def _net(model_class=keras.Model):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", name="c1")(inputs)  # 3 input channels: not centred
    h = keras.layers.Conv2D(16, 3, padding="same", name="c2")(keras.layers.ReLU()(h))
    h = keras.layers.Conv2D(32, 1, name="c3")(keras.layers.ReLU()(h))
    outputs = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling2D()(h))
    return model_class(inputs, outputs)


def _data():
    rng = np.random.default_rng(2)
    return rng.standard_normal((64, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 64)


def _boost(optimizer, **compile_options):
    model = _net(keras_boost.BoostModel)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **compile_options)
    return model


def _step_ops(model):
    x, y = _data()
    data = (tf.constant(x[:16]), tf.constant(y[:16]))
    graph = tf.function(lambda: model.train_step(data)).get_concrete_function().graph
    ops = list(graph.get_operations())
    for function in graph.as_graph_def().library.function:
        ops += list(function.node_def)
    return [getattr(op, "type", None) or op.op for op in ops]


def test_the_step_centres_inside_the_update_and_trains_as_the_two_op_form(monkeypatch):
    """GC and the fused update together: one kernel per centred variable, the same training as without it."""
    x, y = _data()
    results = {}
    for native in ("auto", "0"):
        monkeypatch.setenv("KERAS_BOOST_NATIVE_KERNELS", native)
        model = _boost(keras.optimizers.SGD(0.05, momentum=0.9), gradient_centralization=True, fused_update=True)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        ops = _step_ops(model)
        results[native] = [np.array(w) for w in model.get_weights()]
        centred = ops.count("KerasBoostCentredKerasMomentum")
        # c2, c3 and head are centred (input channels 16, 16, 32); c1 (3) and the biases are not.
        assert centred == (3 if native == "auto" else 0), ops
        assert ops.count("ResourceApplyKerasMomentum") == (8 - centred)
    for a, b in zip(results["auto"], results["0"]):
        # 8 updates through 3 convolutions, the same operations; TensorFlow's kernel may fuse a
        # multiply-add (CPU-dependent), which the forward passes then carry: float32 rounding, grown.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gc_switched_off_hands_zero_sums_and_trains_as_without_gc():
    """A level's GC switched off between steps: the kernel subtracts nothing (the same weights as no GC)."""
    x, y = _data()
    results = []
    for gc in (True, False):
        model = _boost(keras.optimizers.SGD(0.05, momentum=0.9), gradient_centralization=gc, fused_update=True)
        if gc:
            model.boost_step.centralization.switch_off()  # as the self-measurement does, between steps
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        if gc:
            assert "KerasBoostCentredKerasMomentum" in _step_ops(model)
        results.append([np.array(w) for w in model.get_weights()])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)  # g - 0 is g: the same compiled arithmetic on the same inputs


@pytest.mark.parametrize("optimizer, reason", [
    (lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=1.0), "clipnorm changes the gradient"),
    (lambda: keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=1.0), "global_clipnorm changes"),
    (lambda: keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2), "accumulates gradients"),
    (lambda: keras.optimizers.SGD(0.05), "not SGD with momentum"),
    (lambda: keras.optimizers.Adam(1e-3), "not SGD with momentum"),
])
def test_gradients_changed_inside_the_optimizer_are_centred_before_it(optimizer, reason):
    """Where the optimizer changes the gradient before its update (clipping, ...), GC runs first, as always."""
    model = _boost(optimizer(), gradient_centralization=True, fused_update=True)
    kernel = model.trainable_variables[2]  # c2/kernel
    assert kernel.path == "c2/kernel"
    why = centring_unavailable(model.optimizer, kernel, tf.zeros(kernel.shape), model)
    assert why is not None and reason in why
    ops = _step_ops(model)
    assert "KerasBoostCentredKerasMomentum" not in ops


def test_clipping_sees_the_centred_gradient():
    """clipnorm with GC clips the centred gradient (GC before the optimizer), kernel or not."""
    x, y = _data()
    results = []
    for fused in (True, False):
        model = _boost(keras.optimizers.SGD(0.5, momentum=0.9, clipnorm=0.01), gradient_centralization=True,
                       fused_update=fused)
        model.fit(x[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)
        results.append([np.array(w) for w in model.get_weights()])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_xla_steps_keep_the_two_op_form():
    model = _boost(keras.optimizers.SGD(0.05, momentum=0.9), gradient_centralization=True, fused_update=True,
                   jit_compile=True)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # XLA has no form of the kernel: this would fail
    kernel = model.trainable_variables[2]
    assert "XLA" in centring_unavailable(model.optimizer, kernel, tf.zeros(kernel.shape), model)


def test_a_missing_library_warns_once_and_the_step_centres_before_the_update(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", {"library": None, "why": "it is not built (a test's stand-in)"})
    x, y = _data()
    with pytest.warns(UserWarning, match=r"gradient centralization runs as a pass of its own before the update: "
                                         r"it is not built \(a test's stand-in\)") as caught:
        model = _boost(keras.optimizers.SGD(0.05, momentum=0.9), gradient_centralization=True, fused_update=True)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        ops = _step_ops(model)
    assert sum("runs as a pass of its own" in str(w.message) for w in caught) == 1
    assert "KerasBoostCentredKerasMomentum" not in ops and ops.count("ResourceApplyKerasMomentum") == 8
