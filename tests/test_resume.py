"""Exact resume of every boost state: checkpoints mid-window, BackupAndRestore, atomic writes."""

import os

import numpy as np
import pytest

from keras_boost.callbacks import BackupAndRestore
from tests import resume_scenarios
from tests.helpers import classification_data, compile_sgd, mlp


def test_checkpoint_mid_window_resumes_bit_identically(tmp_path):
    reference, resumed = resume_scenarios.checkpoint_mid_window(str(tmp_path))
    assert int(reference.boost_step.stage("loss_scale").overflow_count.numpy()) == 1  # the overflow happened
    assert resume_scenarios.identical(reference, resumed)


def test_backup_and_restore_resumes_bit_identically(tmp_path):
    reference, resumed = resume_scenarios.backup_and_restore(str(tmp_path / "backup"))
    assert int(reference.boost_step.stage("swa").count.numpy()) == 3  # epochs 2-4 averaged, across the crash
    assert int(reference.boost_step.stage("ema").count.numpy()) == 24  # every update's average, across the crash
    assert resume_scenarios.identical(reference, resumed)
    assert not os.path.exists(tmp_path / "backup")  # deleted when training ended


def test_a_crash_while_writing_leaves_the_previous_backup(tmp_path, monkeypatch):
    x, y = classification_data(n=64)
    model = compile_sgd(mlp())
    callback = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    saved = [np.array(w) for w in model.weights]

    def crash_midway(filepath, overwrite=True):
        with open(filepath, "wb") as handle:
            handle.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save_weights", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
    fresh = compile_sgd(mlp(seed=5))
    fresh.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[BackupAndRestore(str(tmp_path))])
    # the resumed run started from the last complete backup (epoch 1), found nothing left to do
    for a, b in zip(saved, fresh.weights):
        np.testing.assert_array_equal(a, np.array(b))


@pytest.mark.parametrize("controller", ["gloo"])
def test_resume_on_two_workers(controller):
    from tests.launch import shared

    found = shared(controller, "resume")  # a scenario of the shared Gloo launch
    for rank in (0, 1):
        assert found[rank]["checkpoint"] and found[rank]["backup"], found[rank]
    assert found[0]["digest"] == found[1]["digest"]
