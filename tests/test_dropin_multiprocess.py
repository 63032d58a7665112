"""BoostModel as a drop-in on 2 Horovod workers: real processes under horovodrun.

Each check is a scenario of the shared launch of its controller (`tests.launch.shared`);
the rank-0-only one is the last scenario of its launch (the other workers exit meanwhile).
"""

import json
import os
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from tests.launch import shared, shared_dir

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import dropin as worker  # noqa: E402


def _flat(model):
    return [np.asarray(w).ravel() for w in model.get_weights()]


def _assert_identical_across_ranks(found):
    for a, b in zip(found[0]["weights"], found[1]["weights"]):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def _global_batch_reference(epochs=2):
    """One process, plain keras.Model, the same train_step, global batch = both ranks' batches."""

    class Plain(keras.Model):
        train_step = worker.CustomStep.train_step

    x, y = worker.data()
    n = len(x) // 2
    b = worker.BATCH
    order = np.concatenate([np.r_[i * b:(i + 1) * b, n + i * b:n + (i + 1) * b] for i in range(n // b)])
    model = worker.compile_sgd(worker.mlp(Plain, seed=0))
    model.fit(x[order], y[order], batch_size=2 * b, epochs=epochs, verbose=0, shuffle=False)
    return _flat(model)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_custom_train_step_on_two_workers_equals_one_process_with_the_global_batch(controller):
    found = shared(controller, "dropin_custom_step")
    _assert_identical_across_ranks(found)
    reference = _global_batch_reference()
    for got, want in zip(found[0]["weights"], reference):
        np.testing.assert_allclose(np.array(got), want, atol=1e-5, rtol=0)
    assert found[0]["loss"] == found[1]["loss"]  # epoch logs averaged across the workers


def test_jit_compile_true_on_two_workers_trains_without_xla_and_warns_once():
    found = shared("gloo", "dropin_jit")
    _assert_identical_across_ranks(found)
    for rank in (0, 1):
        assert len(found[rank]["jit_warnings"]) == 1, found[rank]["jit_warnings"]
        assert "runs without XLA" in found[rank]["jit_warnings"][0]
        assert found[rank]["jit_compile"] is True  # evaluate and predict keep XLA
    assert found[0]["loss"] == pytest.approx(found[1]["loss"], abs=1e-6)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_rank_zero_only_evaluate_predict_and_save(controller):
    found = shared(controller, "dropin_rank0")
    tmp_path = Path(shared_dir(controller, "dropin_rank0"))  # where rank 0 saved
    zero, one = found[0], found[1]
    # evaluate(across_workers=True) on all ranks averages
    mean = (zero["all_local_loss"] + one["all_local_loss"]) / 2
    assert zero["all_evaluate"] == pytest.approx(mean, rel=1e-5)
    assert one["all_evaluate"] == pytest.approx(mean, rel=1e-5)
    assert zero["all_local_loss"] != pytest.approx(one["all_local_loss"], rel=1e-3)  # the average is not trivial
    # the idiom: rank 0's own numbers, no collective and so no warning, a file that loads
    assert zero["rank0_evaluate"] == pytest.approx(zero["rank0_local_loss"], rel=1e-5)
    assert zero["rank0_warnings"] == []
    assert "rank0_evaluate" not in one
    # across_workers=True on rank 0 alone, once the other has exited: a clear error, not a wait
    assert "the other workers have finished" in zero["rank0_across_error"], zero.get("rank0_across_error")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    x, _ = worker.data()
    np.testing.assert_allclose(loaded.predict(x[:4], verbose=0), np.array(zero["rank0_predict"]), atol=1e-6)
    assert (tmp_path / "model.weights.h5").exists()
    _assert_identical_across_ranks(found)


def test_a_script_written_for_one_machine_writes_each_file_once_and_whole_on_two_workers():
    """Keras' file-writing callbacks with the same paths on both workers (across two hosts), then
    both saving one path at the same moment, 12 times: without keras_boost's handling h5py's lock
    fails on the second writer (BlockingIOError) and every CSV row is written twice."""
    found = shared("gloo", "dropin_files")
    directory = Path(shared_dir("gloo", "dropin_files")) / "files"
    for rank in (0, 1):
        assert "error" not in found[rank], found[rank].get("error")
        assert found[rank]["errors"] == [], found[rank]["errors"]
    _assert_identical_across_ranks(found)
    rows = (directory / "log.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("epoch,"), rows  # one header, one row per epoch: one writer
    for rank in (0, 1):  # a path of its own: every worker keeps its log
        assert len((directory / f"log{rank}.csv").read_text().splitlines()) == 3
    assert len(list((directory / "tb" / "train").glob("events.out.tfevents.*"))) == 1
    assert json.loads((directory / "backup" / "training_metadata.json").read_text())["epoch"] == 2
    assert not [p.name for p in directory.rglob("*") if "partial" in p.name]  # every write renamed into place
    model = worker.mlp(keras.Model)
    model.load_weights(directory / "same.weights.h5")
    for got, want in zip(_flat(model), found[0]["weights"]):
        np.testing.assert_array_equal(got, np.array(want))
    for name in ("same.keras", "best.keras"):
        loaded = keras.saving.load_model(directory / name)
        assert len(loaded.get_weights()) == len(found[0]["weights"])
    assert (directory / "e1.weights.h5").exists() and (directory / "e2.weights.h5").exists()


def test_rank_zero_says_when_every_worker_was_given_the_same_arrays():
    found = shared("gloo", "dropin_same_data")
    assert "error" not in found[0], found[0].get("error")
    n = len(worker.data()[0])
    assert len(found[0]["whole"]) == 1 and f"the 2 workers were given the same {n} training samples" in \
        found[0]["whole"][0], found[0]
    assert "keras_boost.app.data.shard((x, y), distributed.rank(), distributed.size())" in found[0]["whole"][0]
    assert found[0]["whole_split"] == found[0]["whole"]  # the same arrays, given with a validation split
    assert found[0]["shards"] == [] and found[1]["whole"] == found[1]["shards"] == []  # rank 0 alone says it
