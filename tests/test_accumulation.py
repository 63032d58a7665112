"""Gradient accumulation (single process): N micro-batches update like one batch of N·b.

References are plain `keras.Model`s trained on the concatenated micro-batches, and Keras'
own `gradient_accumulation_steps`, whose learning-rate schedule counts micro-steps where
keras_boost's counts updates.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import BoostModel, DynamicLossScale, GradientAccumulation
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class RecordingSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`base * rate**step`, writing every step it is evaluated at into a variable."""

    def __init__(self, base=0.1, rate=0.8, slots=64):
        self.base, self.rate = base, rate
        self.seen = tf.Variable(tf.fill([slots], -1), trainable=False)
        self.calls = tf.Variable(0, trainable=False)

    def __call__(self, step):
        step = tf.cast(step, tf.int32)
        self.seen.scatter_nd_update([[self.calls]], [step])
        self.calls.assign_add(1)
        return self.base * tf.pow(self.rate, tf.cast(step, tf.float32))

    def steps(self):
        return [int(s) for s in self.seen.numpy()[: int(self.calls.numpy())]]

    def get_config(self):
        return {"base": self.base, "rate": self.rate}


def reference_model(lr=0.1, seed=0):
    """Plain Keras, same initial weights as `mlp(seed=seed)`."""
    return compile_sgd(mlp(keras.Model, seed=seed), lr=lr)


def micro_steps(model, x, y, batch=16):
    for i in range(0, len(x), batch):
        model.train_on_batch(x[i:i + batch], y[i:i + batch])


def acc_state(model):
    stage = model.boost_step.stage("gradient_accumulation")
    return int(stage.micro_step.numpy()), [np.array(a) for a in stage.accumulators]


# ------------------------------------------------------------------ (a) equivalence
def test_four_micro_batches_equal_one_batch_of_64():
    x, y = classification_data(n=256)
    reference = reference_model()
    reference.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    model = compile_sgd(mlp(), gradient_accumulation=4)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4 == int(reference.optimizer.iterations.numpy())
    assert max_diff(weights(reference), weights(model)) < 1e-5
    # and the model really moved (momentum 0.9 over 4 updates), so the comparison means something
    assert max_diff(weights(mlp(keras.Model, seed=0)), weights(model)) > 1e-2
    # without accumulation the same fit is a different (16-sample) training
    plain = compile_sgd(mlp())
    plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_diff(weights(reference), weights(plain)) > 1e-3


# ------------------------------------------------- (b) Keras' gradient_accumulation_steps
def test_weights_match_keras_gradient_accumulation_steps():
    x, y = classification_data(n=256)
    keras_acc = mlp(keras.Model)
    keras_acc.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=4), loss=LOSS)
    keras_acc.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model = compile_sgd(mlp(), gradient_accumulation=GradientAccumulation(4))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_diff(weights(keras_acc), weights(model)) < 1e-5


def test_schedule_counts_updates_here_and_micro_steps_in_keras():
    x, y = classification_data(n=256)  # 16 micro-batches of 16 = 4 updates of 64
    ours = RecordingSchedule()
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(ours, momentum=0.9), loss=LOSS, gradient_accumulation=4)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    theirs = RecordingSchedule()
    keras_acc = mlp(keras.Model)
    keras_acc.compile(optimizer=keras.optimizers.SGD(theirs, momentum=0.9, gradient_accumulation_steps=4), loss=LOSS)
    keras_acc.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    # keras_boost: the iteration counter and the schedule advance once per update
    assert int(model.optimizer.iterations.numpy()) == 4
    assert ours.steps() == [0, 1, 2, 3]
    # Keras: the raw counter counts micro-batches, the schedule is evaluated at the raw
    # counter (3, 7, 11, 15); only the public `iterations` property divides it by 4
    assert int(keras_acc.optimizer._iterations.numpy()) == 16
    assert int(keras_acc.optimizer.iterations.numpy()) == 4
    assert theirs.steps() == [3, 7, 11, 15]

    # so the weights differ; Keras' equal batch-64 training with the schedule shifted to
    # base * rate**(4k + 3), ours equal it with the schedule unchanged
    assert max_diff(weights(keras_acc), weights(model)) > 1e-3
    same_schedule = mlp(keras.Model)
    same_schedule.compile(optimizer=keras.optimizers.SGD(RecordingSchedule(), momentum=0.9), loss=LOSS)
    same_schedule.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert max_diff(weights(same_schedule), weights(model)) < 1e-5
    shifted = mlp(keras.Model)
    shifted.compile(optimizer=keras.optimizers.SGD(RecordingSchedule(0.1 * 0.8**3, 0.8**4), momentum=0.9), loss=LOSS)
    shifted.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert max_diff(weights(shifted), weights(keras_acc)) < 1e-5


# --------------------------------------------------------------- (c) LR schedule
def test_learning_rate_schedule_steps_once_per_update_across_epochs():
    x, y = classification_data(n=128)  # 8 micro-batches of 16 per epoch = 2 updates
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9), loss=LOSS, gradient_accumulation=4)
    seen = []
    probe = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(
            (int(model.optimizer.iterations.numpy()), float(model.optimizer.learning_rate.numpy()))))
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[probe])
    assert [s for s, _ in seen] == [2, 4, 6]
    np.testing.assert_allclose([lr for _, lr in seen], [0.2 * 0.5**2, 0.2 * 0.5**4, 0.2 * 0.5**6], rtol=1e-6)
    reference = mlp(keras.Model)
    reference.compile(optimizer=keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5), momentum=0.9), loss=LOSS)
    reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    assert max_diff(weights(reference), weights(model)) < 1e-5


# --------------------------------------------------- (d) incomplete window carries over
def test_incomplete_window_carries_over_to_the_next_epoch():
    x, y = classification_data(n=96)  # 6 micro-batches of 16 per epoch, N = 4
    model = compile_sgd(mlp(), gradient_accumulation=4)
    at_epoch_end = []
    probe = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: at_epoch_end.append(
            (int(model.optimizer.iterations.numpy()), acc_state(model)[0])))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[probe])
    assert at_epoch_end == [(1, 2), (3, 0)]  # 2 micro-batches waited over the epoch end
    # 2 epochs = 12 micro-batches = 3 updates on the data seen back to back
    reference = reference_model()
    reference.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert int(reference.optimizer.iterations.numpy()) == 3
    assert max_diff(weights(reference), weights(model)) < 1e-5
    # dropping the partial window at the epoch end instead would be a different training
    dropped = reference_model()
    dropped.fit(np.concatenate([x[:64], x[:64]]), np.concatenate([y[:64], y[:64]]),
                batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert max_diff(weights(dropped), weights(model)) > 1e-4


# ------------------------------------------------ (e) resume in the middle of a window
def _checkpoint_roundtrip(kind, source, target, directory):
    if kind == "save_weights":
        path = str(directory / "mid_window.weights.h5")
        source.save_weights(path)
        target.load_weights(path)
    else:
        path = tf.train.Checkpoint(model=source, optimizer=source.optimizer).write(str(directory / "ckpt"))
        tf.train.Checkpoint(model=target, optimizer=target.optimizer).read(path).assert_consumed()


@pytest.mark.parametrize("kind", ["save_weights", "tf.train.Checkpoint"])
def test_resume_mid_window_is_bit_identical(kind, tmp_path):
    x, y = classification_data(n=16 * 10)  # 10 micro-batches: windows 4 + 4 + 2
    uninterrupted = compile_sgd(mlp(), gradient_accumulation=4)
    micro_steps(uninterrupted, x, y)

    first = compile_sgd(mlp(), gradient_accumulation=4)
    micro_steps(first, x[:96], y[:96])  # 1 update, then 2 micro-batches into the second window
    step, accumulators = acc_state(first)
    assert step == 2 and any(np.abs(a).max() > 0 for a in accumulators)
    resumed = compile_sgd(mlp(seed=5), gradient_accumulation=4)  # different weights before the restore
    _checkpoint_roundtrip(kind, first, resumed, tmp_path)
    assert int(resumed.optimizer.iterations.numpy()) == 1
    r_step, r_accumulators = acc_state(resumed)
    assert r_step == 2
    for a, b in zip(accumulators, r_accumulators):
        np.testing.assert_array_equal(a, b)
    micro_steps(resumed, x[96:], y[96:])

    assert int(resumed.optimizer.iterations.numpy()) == int(uninterrupted.optimizer.iterations.numpy()) == 2
    for a, b in zip(weights(uninterrupted), weights(resumed)):
        assert np.array_equal(a, b)
    for a, b in zip(uninterrupted.optimizer.variables, resumed.optimizer.variables):
        assert np.array_equal(np.array(a), np.array(b))
    assert acc_state(resumed)[0] == acc_state(uninterrupted)[0] == 2
    for a, b in zip(acc_state(uninterrupted)[1], acc_state(resumed)[1]):
        assert np.array_equal(a, b)


# ------------------------------------------------------- (f) overflow drops the window
def test_overflow_in_one_micro_batch_drops_the_whole_window():
    x, y = classification_data(n=16 * 8, seed=3)
    x = x.copy()
    x[16 * 2, 0] = np.inf  # third micro-batch of the first window
    model = compile_sgd(mlp(), gradient_accumulation=4, loss_scale=DynamicLossScale(init_scale=1024.0))
    before_w, before_slots = weights(model), [np.array(v) for v in model.optimizer.variables]
    logs = [model.train_on_batch(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)], return_dict=True)
            for i in range(4)]
    assert [float(l["loss_scale"]) for l in logs] == [1024.0, 1024.0, 1024.0, 512.0]  # halved once, at the boundary
    assert int(logs[-1]["overflow"]) == 1
    for a, b in zip(before_w, weights(model)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(before_slots, model.optimizer.variables):
        np.testing.assert_array_equal(a, np.array(b))  # slots and iterations unchanged
    assert int(model.optimizer.iterations.numpy()) == 0
    step, accumulators = acc_state(model)
    assert step == 0 and all(not np.any(a) for a in accumulators)  # reset: the inf/NaN is gone

    logs = [model.train_on_batch(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)], return_dict=True)
            for i in range(4, 8)]
    assert int(logs[-1]["overflow"]) == 0 and float(logs[-1]["loss_scale"]) == 512.0
    assert int(model.optimizer.iterations.numpy()) == 1
    # the second window trained as if the first had never happened
    reference = reference_model()
    reference.train_on_batch(x[64:], y[64:])
    assert max_diff(weights(reference), weights(model)) < 1e-5


# ----------------------------------------------------------- (g) BatchNorm statistics
def test_batchnorm_statistics_update_on_every_micro_batch():
    def bn_model(model_class):
        keras.utils.set_random_seed(0)
        x_in = keras.Input((8,))
        h = keras.layers.Dense(16, name="hidden")(x_in)
        h = keras.layers.BatchNormalization(momentum=0.9, name="bn")(h)
        out = keras.layers.Dense(4, name="logits")(keras.layers.Activation("tanh")(h))
        return model_class(x_in, out)

    x, y = classification_data(n=64, seed=4)
    model = compile_sgd(bn_model(BoostModel), gradient_accumulation=4)
    bn = model.get_layer("bn")
    initial_mean, initial_w = np.array(bn.moving_mean), weights(model)
    # the reference: 4 training-mode forward passes of an untouched copy
    probe = bn_model(keras.Model)
    for i in range(4):
        model.train_on_batch(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
        probe(x[16 * i:16 * (i + 1)], training=True)
        if i == 0:
            assert np.abs(np.array(bn.moving_mean) - initial_mean).max() > 1e-4
            assert int(model.optimizer.iterations.numpy()) == 0
            for a, b in zip(initial_w, weights(model)):
                np.testing.assert_array_equal(a, b)  # no update was applied
        # every forward pass of the window runs with the weights of the window's start,
        # so the statistics are exactly the probe's after each micro-batch
        np.testing.assert_allclose(np.array(bn.moving_mean), np.array(probe.get_layer("bn").moving_mean), atol=1e-6)
        np.testing.assert_allclose(np.array(bn.moving_variance), np.array(probe.get_layer("bn").moving_variance),
                                   atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 1


# ---------------------------------------------------------------- (h) bad inputs
def test_bad_accumulation_steps_are_refused():
    with pytest.raises(ValueError, match="got 0"):
        GradientAccumulation(0)
    for bad in (2.5, "4", True):
        with pytest.raises(TypeError, match=f"got {bad!r}"):
            GradientAccumulation(bad)
    with pytest.raises(TypeError, match="optimizer"):
        GradientAccumulation(4, optimizer="sgd")
    with pytest.raises(ValueError, match="-1"):
        mlp().compile(optimizer="sgd", loss=LOSS, gradient_accumulation=-1)
    with pytest.raises(TypeError, match="2.5"):
        mlp().compile(optimizer="sgd", loss=LOSS, gradient_accumulation=2.5)
    assert GradientAccumulation(np.int64(3)).max_accumulation_step == 3
    model = mlp()
    model.compile(optimizer="sgd", loss=LOSS, gradient_accumulation=1)
    assert model.boost_step.stage("gradient_accumulation") is None  # 1 turns accumulation off
