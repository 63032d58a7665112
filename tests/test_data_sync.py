"""Single-process parts of the never-hang machinery (the multi-process runs are in test_never_hang.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import BoostModel, distributed
from keras_boost.fit import data_sync, watchdog
from tests.helpers import compile_sgd, mlp


def test_stall_timeout_values():
    assert distributed._stall_timeout_value(5) == 5.0
    assert distributed._stall_timeout_value(0) == 0.0
    for bad in (-1, "soon", True, float("nan"), float("inf"), [3]):
        with pytest.raises(ValueError, match="`stall_timeout` must be a non-negative number"):
            distributed._stall_timeout_value(bad)


def test_stall_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv(distributed.STALL_TIMEOUT_ENV, "12.5")
    assert distributed._stall_timeout_value(None) == 12.5
    monkeypatch.setenv(distributed.STALL_TIMEOUT_ENV, "-3")
    with pytest.raises(ValueError, match="KERAS_BOOST_STALL_TIMEOUT"):
        distributed._stall_timeout_value(None)
    monkeypatch.delenv(distributed.STALL_TIMEOUT_ENV)
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60")  # Horovod's own setting is respected
    assert distributed._stall_timeout_value(None) == 60
    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    assert distributed._stall_timeout_value(None) == distributed.DEFAULT_STALL_TIMEOUT == 600


def test_stall_check_period_warns_before_the_shutdown():
    assert distributed.stall_check_seconds(10) == 5
    assert distributed.stall_check_seconds(600) == 60
    assert distributed.stall_check_seconds(1) == 1


def test_watchdog_validates_its_timeout():
    with pytest.raises(ValueError, match="timeout must be a non-negative number"):
        watchdog.StallWatchdog(timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        watchdog.StallWatchdog(timeout="1")


def test_fingerprints_ignore_generated_names_and_see_shapes():
    keras.layers.Dense(3)  # bumps Keras' name counters, as an extra model on one rank would
    a = compile_sgd(mlp(BoostModel))
    b = compile_sgd(mlp(BoostModel))
    args = {"batch_size": 16, "epochs": 2}
    assert data_sync._differences([data_sync.fingerprint(a, args), data_sync.fingerprint(b, args)]) == []
    wide = compile_sgd(mlp(BoostModel, hidden=32))
    found = data_sync._differences([data_sync.fingerprint(a, args), data_sync.fingerprint(wide, args)])
    assert found == ["variable shapes: rank 0 has hidden/kernel (8, 16) float32, rank 1 has hidden/kernel (8, 32) "
                     "float32"]
    lr = compile_sgd(mlp(BoostModel), lr=0.2)
    found = data_sync._differences([data_sync.fingerprint(a, args), data_sync.fingerprint(lr, args)])
    assert found == ["compile option 'optimizer.config.learning_rate': rank 0 has 0.10000000149011612, rank 1 has "
                     "0.20000000298023224"]
    found = data_sync._differences([data_sync.fingerprint(a, args),
                                    data_sync.fingerprint(a, {"batch_size": 16, "epochs": 3})])
    assert found == ["fit argument 'epochs': rank 0 has 2, rank 1 has 3"]


def test_single_process_is_untouched():
    model = compile_sgd(mlp(BoostModel))
    arguments = {"x": [1], "batch_size": 4}
    assert data_sync.prepare_fit(model, arguments) is arguments
    import tensorflow as tf

    ds = tf.data.Dataset.range(3)
    assert data_sync.end_together(ds) is ds


def test_fit_arguments_bind_positionals():
    from keras_boost.model import _fit_arguments

    assert _fit_arguments((1, 2, 16), {"epochs": 3}) == {"x": 1, "y": 2, "batch_size": 16, "epochs": 3}
    with pytest.raises(TypeError, match="multiple values for argument 'y'"):
        _fit_arguments((1, 2), {"y": 3})
    with pytest.raises(TypeError, match="positionally"):
        _fit_arguments((1, 2, 3, 4, 5), {})


# ------------------------------------------------------------- epoch-start stalls (one process too)
def test_arrays_reach_keras_as_its_own_dataset_without_autotuning():
    from keras_boost._keras_compat import without_epoch_stalls

    x = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
    y = np.arange(50, dtype=np.float32)
    args = without_epoch_stalls({"x": x, "y": y, "batch_size": 8, "shuffle": False, "validation_split": 0.2})
    dataset = args["x"]
    assert isinstance(dataset, tf.data.Dataset) and dataset.options().autotune.enabled is False
    assert int(dataset.cardinality()) == 5  # 40 training samples in batches of 8: Keras' count, known
    batches = [(bx.numpy(), by.numpy()) for bx, by in dataset]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), x[:40])  # same order, same samples
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), y[:40])
    # validation_split is Keras' own: the last 20%, validated in batches of the training batch size
    np.testing.assert_array_equal(args["validation_data"][0], x[40:])
    assert args["validation_batch_size"] == 8 and args["validation_split"] == 0.0
    assert args["y"] is None and args["batch_size"] is None and args["shuffle"] is False


def test_datasets_and_explicit_steps_are_left_to_keras():
    from keras_boost._keras_compat import without_epoch_stalls

    dataset = tf.data.Dataset.from_tensor_slices((np.zeros((4, 2)), np.zeros(4))).batch(2)
    assert without_epoch_stalls({"x": dataset})["x"] is dataset
    arrays = {"x": np.zeros((4, 2)), "y": np.zeros(4), "steps_per_epoch": 2}
    assert without_epoch_stalls(arrays) is arrays


def test_the_sample_digest_tells_the_same_arrays_from_a_workers_part():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(1000, 4)).astype("float32"), rng.integers(0, 3, 1000)
    whole = data_sync.sample_digest((x, y, None))
    assert whole == data_sync.sample_digest((x.copy(), y.copy(), None)) and whole[1] == 1000
    parts = [data_sync.sample_digest((x[r::2], y[r::2], None)) for r in (0, 1)]
    assert parts[0] != parts[1] and whole not in parts
    changed = y.copy()
    changed[-1] += 1  # the last row is one of the 16 rows read
    assert data_sync.sample_digest((x, changed, None)) != whole
    assert data_sync.sample_digest(({"a": x}, y, None)) is not None  # a dict of inputs
    assert data_sync.sample_digest(([[1.0, 2.0]], None, None)) is None  # not arrays: nothing said


def test_the_same_data_line_needs_every_worker_alike():
    same = ("d", 1000)
    assert "the 3 workers were given the same 1000 training samples" in data_sync.same_data_line([same] * 3)
    assert data_sync.same_data_line([same, ("e", 1000)]) is None
    assert data_sync.same_data_line([None, None]) is None and data_sync.same_data_line([same]) is None
