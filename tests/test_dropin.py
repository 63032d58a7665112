"""BoostModel as a drop-in for keras.Model in ordinary Keras code, one process."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_boost
from keras_boost import BoostModel
from keras_boost.fit import dropin
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights


# ------------------------------------------------------------ 1. compute_loss without `training`
def _distiller_class(base):
    """The Keras 3 knowledge-distillation example's Distiller (compute_loss has no `training`)."""

    class Distiller(base):
        def __init__(self, student, teacher):
            super().__init__()
            self.teacher = teacher
            self.student = student

        def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
            super().compile(optimizer=optimizer, metrics=metrics)
            self.student_loss_fn = student_loss_fn
            self.distillation_loss_fn = distillation_loss_fn
            self.alpha = alpha
            self.temperature = temperature

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
            teacher_pred = self.teacher(x, training=False)
            student_loss = self.student_loss_fn(y, y_pred)
            distillation_loss = self.distillation_loss_fn(
                ops.softmax(teacher_pred / self.temperature, axis=1),
                ops.softmax(y_pred / self.temperature, axis=1),
            ) * (self.temperature ** 2)
            return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

        def call(self, x):
            return self.student(x)

    return Distiller


def _train_distiller(base):
    teacher = mlp(keras.Model, seed=3)
    student = mlp(keras.Model, hidden=8, seed=4)
    distiller = _distiller_class(base)(student=student, teacher=teacher)
    distiller.compile(optimizer=keras.optimizers.Adam(0.01), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
    x, y = classification_data(n=64)
    history = distiller.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return weights(student), history.history


def test_distiller_with_compute_loss_without_training_argument_trains_like_keras():
    boost_weights, boost_history = _train_distiller(BoostModel)
    keras_weights, keras_history = _train_distiller(keras.Model)
    assert max_diff(boost_weights, keras_weights) < 1e-5
    np.testing.assert_allclose(boost_history["loss"], keras_history["loss"], rtol=1e-5)


# -------------------------------------------------------------- 2. weights equal keras.Model's
def _pair(**boost):
    plain = compile_sgd(mlp(keras.Model, seed=5))
    boosted = compile_sgd(mlp(BoostModel, seed=6), loss_scale="dynamic", gradient_accumulation=2, **boost)
    return plain, boosted


def test_boost_state_is_not_a_model_weight():
    plain, boosted = _pair()
    assert boosted.boost_state.variables  # the stages created their state
    assert len(boosted.weights) == len(plain.weights)
    assert len(boosted.get_weights()) == len(plain.get_weights())
    assert boosted.count_params() == plain.count_params()
    assert [v.path for v in boosted.weights] == [v.path for v in plain.weights]


def test_set_weights_both_ways():
    plain, boosted = _pair()
    boosted.set_weights(plain.get_weights())
    assert max_diff(weights(boosted), weights(plain)) == 0.0
    other = compile_sgd(mlp(keras.Model, seed=9))
    other.set_weights(boosted.get_weights())
    assert max_diff(weights(other), weights(boosted)) == 0.0


def test_weights_h5_interop_both_ways(tmp_path):
    plain, boosted = _pair()
    boosted.boost_step.stage("loss_scale").scale.assign(64.0)
    plain.save_weights(tmp_path / "plain.weights.h5")
    boosted.load_weights(tmp_path / "plain.weights.h5")  # a plain Keras file: the boost state is kept
    assert max_diff(weights(boosted), weights(plain)) == 0.0
    assert float(boosted.boost_step.stage("loss_scale").scale.numpy()) == 64.0

    boosted.layers[1].kernel.assign(boosted.layers[1].kernel + 1.0)
    boosted.save_weights(tmp_path / "boost.weights.h5")
    fresh = compile_sgd(mlp(keras.Model, seed=11))
    fresh.load_weights(tmp_path / "boost.weights.h5")
    assert max_diff(weights(fresh), weights(boosted)) == 0.0
    # and the boost state comes back into a BoostModel, even one loaded before compile
    again = mlp(BoostModel, seed=12)
    again.load_weights(tmp_path / "boost.weights.h5")
    compile_sgd(again, loss_scale="dynamic", gradient_accumulation=2)
    again.boost_step.build(again.boost_state)
    assert float(again.boost_step.stage("loss_scale").scale.numpy()) == 64.0
    assert max_diff(weights(again), weights(boosted)) == 0.0


# ---------------------------------------------------------- 7. gradient-centralization optimizer
def _one_step(model, optimizer, x, y):
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, shuffle=False)
    return weights(model)


@pytest.mark.parametrize("rule", ["all", "mindspore"])
def test_gc_optimizer_wrapper_on_a_plain_keras_model(rule):
    x, y = classification_data(n=32, inputs=16)
    model = mlp(keras.Model, inputs=16, hidden=16, seed=7)
    before = weights(model)
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    lr = 0.5
    expected = []
    for w, g in zip(before, grads):
        centred = g.ndim >= 2 and (rule == "all" or g.shape[-2] % 16 == 0)
        expected.append(w - lr * (g - g.mean(axis=tuple(range(g.ndim - 1)), keepdims=True) if centred else g))
    stage = keras_boost.GradientCentralization.every_kernel() if rule == "all" else None  # None: the stage's default
    after = _one_step(model, keras_boost.optimizers.CentralizedOptimizer(keras.optimizers.SGD(lr), stage), x, y)
    assert max_diff(after, expected) < 1e-5
    # the 16-input hidden kernel is centred under both rules; the 16x4 logits kernel too
    assert max_diff([after[0]], [before[0] - lr * grads[0]]) > 1e-4


def test_gc_optimizer_round_trips_through_a_keras_file(tmp_path):
    x, y = classification_data(n=32)
    model = mlp(keras.Model, seed=8)
    _one_step(model, keras_boost.optimizers.CentralizedOptimizer(keras.optimizers.Adam(0.01)), x, y)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, keras_boost.optimizers.CentralizedOptimizer)
    assert loaded.optimizer.centralization.min_channels_multiple == 16
    assert [loaded.optimizer.applies_to(v) for v in loaded.trainable_variables] == [
        model.optimizer.applies_to(v) for v in model.trainable_variables]
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_gc_optimizer_bad_input():
    with pytest.raises(TypeError, match="`inner_optimizer` must be a keras.optimizers.Optimizer"):
        keras_boost.optimizers.CentralizedOptimizer("sgd")
    with pytest.raises(TypeError, match="`centralization` must be a keras_boost.GradientCentralization or None, got 'all'"):
        keras_boost.optimizers.CentralizedOptimizer(keras.optimizers.SGD(), "all")


def test_compile_gradient_centralization_all_selects_every_kernel():
    model = compile_sgd(mlp(seed=2), gradient_centralization="all")
    assert [v.path for v in model.boost_step.stage("gradient_centralization").variables] == [
        v.path for v in model.trainable_variables if len(v.shape) >= 2]
    assert model.boost_step.stage("gradient_centralization").min_channels_multiple == 1
    default = compile_sgd(mlp(seed=2), gradient_centralization=True)
    assert default.boost_step.stage("gradient_centralization").min_channels_multiple == 16
    with pytest.raises(ValueError, match="`gradient_centralization` must be None, a bool, 'mindspore', 'all'"):
        compile_sgd(mlp(seed=2), gradient_centralization="every")


# -------------------------------------------------------------------------------- 8. logs
def test_boost_scalars_stay_out_of_the_bar_but_in_the_history(capsys):
    x, y = classification_data(n=64)
    model = compile_sgd(mlp(seed=1), loss_scale="dynamic")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "loss:" in out and "accuracy:" in out
    assert "loss_scale" not in out and "overflow" not in out
    assert "loss_scale" in history.history and "overflow" in history.history


def test_launcher_with_non_terminal_output_prints_one_line_per_epoch(monkeypatch):
    assert dropin.launcher_verbose("auto") == "auto"  # no launcher: Keras decides
    monkeypatch.setenv("HOROVOD_RANK", "0")
    assert dropin.launcher_verbose("auto") == 2  # pytest's stdout is not a terminal
    assert dropin.launcher_verbose(1) == 1  # a bar when asked for


# ------------------------------------------------------ 3. distributed optimizer, one process
def test_custom_train_step_in_one_process_equals_keras():
    class Custom(BoostModel):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    class Plain(keras.Model):
        train_step = Custom.train_step

    x, y = classification_data(n=64)
    results = []
    for cls in (Custom, Plain):
        model = mlp(cls, seed=13)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        results.append(weights(model))
    assert max_diff(*results) < 1e-6


# ---------------------------------------------------------------- one writer per file
def _writers(directory, rank):
    """What a script written for one machine gives fit on worker `rank` (two paths of its own)."""
    return [keras.callbacks.CSVLogger(f"{directory}/log.csv"), keras.callbacks.CSVLogger(f"{directory}/log{rank}.csv"),
            keras.callbacks.TensorBoard(f"{directory}/tb"), keras.callbacks.ModelCheckpoint(f"{directory}/m.keras"),
            keras.callbacks.BackupAndRestore(f"{directory}/backup", save_freq=3, delete_checkpoint=False),
            keras.callbacks.EarlyStopping()]


def test_a_path_several_workers_log_to_is_written_by_one_and_keras_backup_becomes_the_jobs():
    workers = [_writers("out", rank) for rank in range(3)]
    gathered = [dropin.written_paths(callbacks) for callbacks in workers]
    lines = {}
    for rank, callbacks in enumerate(workers):
        given = list(callbacks)
        lines[rank] = dropin.one_writer_per_file(callbacks, gathered, rank)
        shared_log, own_log, board, checkpoint, backup, stopping = callbacks
        assert (shared_log is given[0]) == (rank == 0) and (board is given[2]) == (rank == 0)
        if rank:  # the others get a callback that does nothing
            assert type(shared_log) is keras.callbacks.Callback and type(board) is keras.callbacks.Callback
        assert own_log is given[1] and checkpoint is given[3] and stopping is given[5]  # kept on every worker
        assert type(backup) is keras_boost.callbacks.BackupAndRestore  # rank 0 writes it and restores for all
        assert (backup.backup_dir, backup.save_freq, backup.delete_checkpoint) == ("out/backup", 3, False)
    assert lines[0] == lines[1] == lines[2] and len(lines[0]) == 2
    assert "CSVLogger('out/log.csv'), TensorBoard('out/tb') write on rank 0 alone" in lines[0][0]
    assert "BackupAndRestore('out/backup') runs as keras_boost.callbacks.BackupAndRestore" in lines[0][1]


def test_the_horovod_idiom_of_writers_on_rank_zero_alone_is_left_as_it_is():
    zero = [keras.callbacks.CSVLogger("log.csv"), keras.callbacks.TensorBoard("tb")]
    given = list(zero)
    gathered = [dropin.written_paths(zero), dropin.written_paths([])]
    assert dropin.one_writer_per_file(zero, gathered, 0) == [] and zero == given


@pytest.mark.parametrize("where, lacking", [([0], [1, 2]), ([0, 1], [2]), ([1, 2], [0])])
def test_a_backup_some_workers_lack_is_an_error_that_names_them(where, lacking):
    workers = [[keras_boost.callbacks.BackupAndRestore("bk")] if rank in where else [] for rank in range(3)]
    gathered = [dropin.written_paths(callbacks) for callbacks in workers]
    expected = f"BackupAndRestore('bk') is given to fit on rank(s) {where} but not on rank(s) {lacking}: "
    with pytest.raises(ValueError, match=re.escape(expected) + ".* on every worker"):
        dropin.one_writer_per_file(workers[0], gathered, 0)


def test_a_backup_of_its_own_on_every_worker_is_kept():
    workers = [[keras.callbacks.BackupAndRestore(f"bk{rank}")] for rank in range(2)]
    gathered = [dropin.written_paths(callbacks) for callbacks in workers]
    for rank in (0, 1):
        given = workers[rank][0]
        assert dropin.one_writer_per_file(workers[rank], gathered, rank) == [] and workers[rank][0] is given


def test_one_process_saves_where_keras_saves(tmp_path):
    seen = []
    dropin.write_whole(tmp_path / "m.weights.h5", seen.append)
    assert seen == [tmp_path / "m.weights.h5"]  # no file of its own to rename: one writer


def test_every_stage_declares_the_keys_it_logs():
    """The bar hides the boost scalars by the keys the stages declare (`Stage.log_keys`): they are exactly
    the keys the built step logs, freezing's and the loss scale's included."""
    from keras_boost import FreezeOpt, split_parameters_groups

    x, y = classification_data(n=64)
    model = mlp(seed=1)
    optimizer = keras.optimizers.SGD(0.05)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  loss_scale="dynamic", gradient_freeze=FreezeOpt(optimizer, split_parameters_groups(model, 2), [0, 1]))
    declared = model.boost_step.log_keys()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert sorted(declared) == sorted(model.boost_step.logs()) == ["freeze_group", "loss_scale", "overflow"]
    assert set(declared) <= set(history.history)
