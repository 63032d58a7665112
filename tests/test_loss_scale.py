"""Loss scaling: exact skip on overflow, the scale's rules, Keras' LossScaleOptimizer as reference."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import BoostModel, BoostTrainOneStepWithLossScale, DynamicLossScale, FixedLossScale
from tests.helpers import classification_data, compile_sgd, mlp, weights


def batches(n_steps, overflow_steps=(), seed=3):
    """Per step a batch of 16; at the steps in `overflow_steps` one input is inf."""
    x, y = classification_data(n=16 * n_steps, seed=seed)
    x = x.copy()
    for step in overflow_steps:
        x[16 * step, 0] = np.inf
    return [(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)]) for i in range(n_steps)]


def run(model, data):
    scales, overflows = [], []
    for xb, yb in data:
        logs = model.train_on_batch(xb, yb, return_dict=True)
        scales.append(float(logs["loss_scale"]))
        overflows.append(int(logs["overflow"]))
    return scales, overflows


def test_overflow_skips_the_whole_update_exactly():
    model = compile_sgd(mlp(), loss_scale=DynamicLossScale(init_scale=1024.0))
    data = batches(3, overflow_steps=[1])
    run(model, data[:1])
    before_w, before_slots = weights(model), [np.array(v) for v in model.optimizer.variables]
    scales, overflows = run(model, data[1:2])
    assert overflows == [1] and scales == [512.0]
    for a, b in zip(before_w, weights(model)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(before_slots, model.optimizer.variables):
        np.testing.assert_array_equal(a, np.array(b))  # slots and iterations unchanged
    assert int(model.optimizer.iterations.numpy()) == 1
    run(model, data[2:])
    assert int(model.optimizer.iterations.numpy()) == 2


def test_scale_grows_after_window_and_respects_max():
    model = compile_sgd(mlp(), loss_scale=DynamicLossScale(init_scale=4.0, scale_window=2, max_scale=8.0))
    scales, _ = run(model, batches(6))
    assert scales == [4.0, 8.0, 8.0, 8.0, 8.0, 8.0]


def test_min_scale_is_a_floor():
    model = compile_sgd(mlp(), loss_scale=DynamicLossScale(init_scale=4.0, min_scale=2.0))
    scales, overflows = run(model, batches(3, overflow_steps=[0, 1, 2]))
    assert overflows == [1, 1, 1] and scales == [2.0, 2.0, 2.0]


def test_hysteresis_needs_consecutive_overflows():
    model = compile_sgd(mlp(), loss_scale=DynamicLossScale(init_scale=64.0, hysteresis=2))
    scales, overflows = run(model, batches(6, overflow_steps=[0, 2, 3, 4]))
    assert overflows == [1, 0, 1, 1, 1, 0]
    assert scales == [64.0, 64.0, 64.0, 32.0, 32.0, 32.0]


def test_decisions_match_keras_loss_scale_optimizer():
    """Same initial scale, factor 2, same window, injected overflows: same scales, same weights."""
    data = batches(12, overflow_steps=[1, 2, 7])
    reference = mlp(keras.Model)
    reference.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=2.0**15, dynamic_growth_steps=3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref_scales = []
    for xb, yb in data:
        reference.train_on_batch(xb, yb)
        ref_scales.append(float(reference.optimizer.dynamic_scale.numpy()))
    model = compile_sgd(mlp(), loss_scale=DynamicLossScale(init_scale=2.0**15, scale_window=3))
    scales, overflows = run(model, data)
    assert scales == ref_scales
    assert overflows == [0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    for a, b in zip(weights(reference), weights(model)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_fixed_scale_drop_and_apply():
    data = batches(2, overflow_steps=[1])
    dropping = compile_sgd(mlp(), loss_scale=FixedLossScale(128.0))
    run(dropping, data)
    assert all(np.isfinite(w).all() for w in weights(dropping))
    applying = compile_sgd(mlp(), loss_scale=FixedLossScale(128.0, drop_overflow_update=False))
    scales, overflows = run(applying, data)
    assert overflows == [0, 1] and scales == [128.0, 128.0]
    assert not all(np.isfinite(w).all() for w in weights(applying))  # the seed's semantics


def test_scaled_step_equals_unscaled_step():
    data = batches(4)
    plain = compile_sgd(mlp())
    scaled = compile_sgd(mlp(), loss_scale=FixedLossScale(2.0**10))
    for xb, yb in data:
        plain.train_on_batch(xb, yb)
        scaled.train_on_batch(xb, yb)
    for a, b in zip(weights(plain), weights(scaled)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sense", [tf.constant(64.0), tf.constant([64.0]), np.array(64.0, np.float32)])
def test_scale_sense_tensor_forms(sense):
    model = mlp()
    step = BoostTrainOneStepWithLossScale(model, keras.optimizers.SGD(0.1), sense)
    assert isinstance(step.stage("loss_scale"), FixedLossScale) and step.stage("loss_scale").value == 64.0


def test_scale_sense_variable_is_changed_from_the_host():
    sense = tf.Variable(64.0)
    model = compile_sgd(mlp(), loss_scale=sense)
    run(model, batches(1))
    sense.assign(8.0)
    scales, _ = run(model, batches(1))
    assert scales == [8.0]
    model.boost_step.stage("loss_scale").scale.assign(4.0)
    assert float(sense.numpy()) == 4.0


@pytest.mark.parametrize("sense, error, match", [
    (tf.constant([1.0, 2.0]), ValueError, r"shape of scale_sense must be \(1,\) or \(\)"),
    (tf.zeros((1, 1)), ValueError, "shape of scale_sense"),
    ("dynamic", TypeError, "scale_sense must be"),
    (1024.0, TypeError, "scale_sense must be"),
    (None, TypeError, "scale_sense must be"),
    (tf.constant(-1.0), ValueError, "`scale_sense` must be a finite number > 0, got -1.0"),
    (tf.constant(np.nan), ValueError, "`scale_sense` must be a finite number > 0, got nan"),
])
def test_bad_scale_sense(sense, error, match):
    with pytest.raises(error, match=match):
        BoostTrainOneStepWithLossScale(mlp(), keras.optimizers.SGD(0.1), sense)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"init_scale": 0}, ValueError, "`init_scale` must be a finite number > 0, got 0"),
    ({"init_scale": float("nan")}, ValueError, "`init_scale` must be a finite number > 0, got nan"),
    ({"init_scale": "big"}, TypeError, "`init_scale` must be a finite number > 0, got 'big'"),
    ({"scale_factor": 1}, ValueError, "`scale_factor` must be a finite number > 1, got 1"),
    ({"scale_window": 0}, ValueError, "`scale_window` must be a positive int, got 0"),
    ({"scale_window": 2.5}, TypeError, "`scale_window` must be a positive int, got 2.5"),
    ({"min_scale": 0}, ValueError, "`min_scale` must be a finite number > 0, got 0"),
    ({"min_scale": 4, "max_scale": 2, "init_scale": 3}, ValueError, "max_scale .* must be >= min_scale"),
    ({"init_scale": 2**20, "max_scale": 2**10}, ValueError, "init_scale .* must lie in"),
    ({"hysteresis": 0}, ValueError, "`hysteresis` must be a positive int, got 0"),
    ({"hysteresis": True}, TypeError, "`hysteresis` must be a positive int, got True"),
])
def test_bad_dynamic_scale(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScale(**kwargs)


def test_bad_fixed_scale_and_compile_option():
    with pytest.raises(ValueError, match="`value` must be a finite number > 0"):
        FixedLossScale(0.0)
    with pytest.raises(TypeError, match="`drop_overflow_update` must be a bool"):
        FixedLossScale(2.0, drop_overflow_update="yes")
    with pytest.raises(ValueError, match="`loss_scale` must be None, 'auto', False, 'dynamic'"):
        compile_sgd(mlp(), loss_scale="static")


def test_policy_picks_the_default_scale():
    keras.config.set_dtype_policy("mixed_float16")
    assert isinstance(compile_sgd(mlp()).boost_step.stage("loss_scale"), DynamicLossScale)
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert compile_sgd(mlp()).boost_step.stage("loss_scale") is None  # bfloat16 has float32's range
    keras.config.set_dtype_policy("float32")
    assert compile_sgd(mlp()).boost_step.stage("loss_scale") is None


def test_a_keras_loss_scale_optimizer_is_the_loss_scale():
    """The user's LossScaleOptimizer scales the loss, as in keras.Model: no second scale by default
    (not even under mixed_float16), and an explicit `loss_scale` beside it is refused at compile."""
    def lso():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))

    keras.config.set_dtype_policy("mixed_float16")
    model = mlp()
    model.compile(optimizer=lso(), loss="sparse_categorical_crossentropy")
    assert model.boost_step.stage("loss_scale") is None
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    keras.config.set_dtype_policy("float32")
    for loss_scale in ("dynamic", 128.0, DynamicLossScale()):
        with pytest.raises(ValueError, match="`loss_scale` is given .* LossScaleOptimizer"):
            mlp().compile(optimizer=lso(), loss="sparse_categorical_crossentropy", loss_scale=loss_scale)
    model = mlp()  # False: none of keras_boost's, the LossScaleOptimizer's only
    model.compile(optimizer=lso(), loss="sparse_categorical_crossentropy", loss_scale=False)
    assert model.boost_step.stage("loss_scale") is None


def test_gradient_clipping_clips_the_gradients_a_loss_scale_optimizer_unscales():
    """`gradient_clipping` with Keras' LossScaleOptimizer (whose scale is still in the gradients
    at the clip) clips as without it: the scale is a power of 2, so the same weights, bit for bit.
    Until this was mended the clip acted on gradients 2**12 times too large."""
    x, y = classification_data(n=128)
    trained = []
    for optimizer in (keras.optimizers.SGD(0.5), keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.5), initial_scale=2.0**12, dynamic_growth_steps=1000)):
        model = mlp()
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      gradient_clipping=0.05)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        trained.append(weights(model))
    unclipped = mlp()
    unclipped.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    unclipped.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(*trained):
        np.testing.assert_array_equal(a, b)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(trained[0], weights(unclipped))) > 1e-2  # it clipped


def test_logs_carry_overflow_and_scale():
    model = compile_sgd(mlp(), loss_scale=DynamicLossScale(init_scale=8.0))
    x, y = classification_data(n=64)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert history.history["loss_scale"] == [8.0, 8.0]
    assert history.history["overflow"] == [0, 0]
    assert isinstance(model, BoostModel)


def test_all_finite_sees_every_non_finite_entry_and_no_false_alarm():
    from keras_boost.core.contract import all_finite

    big = tf.fill([100], 3e36)  # each sums to 3e38 (finite); a float32 sum over both tensors would overflow
    assert bool(all_finite([big, big, None, tf.constant([[1.0, 2.0]], tf.float64)]))
    for bad in (np.nan, np.inf, -np.inf):
        values = np.ones((64, 33), np.float32)
        values[17, 5] = bad
        assert not bool(all_finite([tf.ones([3]), tf.constant(values)]))
    # +inf in one gradient and -inf in another must not cancel; float16 is checked entry by entry
    assert not bool(all_finite([tf.constant([np.inf], tf.float32), tf.constant([-np.inf], tf.float32)]))
    assert bool(all_finite([tf.fill([100], tf.constant(60000.0, tf.float16))]))
    assert not bool(all_finite([tf.constant([1.0, np.nan], tf.float16)]))
    assert bool(all_finite([]))
    # many gradients whose values total beyond float32's limit: no false alarm; an inf or NaN in any is seen
    smalls = [tf.fill([50], 3e36) for _ in range(5)]  # 7.5e38 together: finite, beyond float32's limit
    assert bool(all_finite([*smalls, tf.ones([70000])]))
    for position in range(5):
        bad = list(smalls)
        bad[position] = tf.tensor_scatter_nd_update(bad[position], [[7]], [np.inf if position % 2 else np.nan])
        assert not bool(all_finite([*bad, tf.ones([70000])]))
        assert not bool(tf.function(all_finite)([*bad, tf.ones([70000])]))
