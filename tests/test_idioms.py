"""Horovod users' own idioms (tests/workers/idioms.py) on 2 workers, under Gloo and MPI, on this machine
alone and across two namespace hosts: each ends by itself, within a bound, with the result the user meant."""

import os
import sys
from pathlib import Path

import keras
import pytest

from tests.launch import run_ok, shared, shared_dir

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import idioms as worker  # noqa: E402


def check(found, directory):
    zero, one = found[0], found[1]
    for rank in (0, 1):
        # 1. rank 0 evaluates and saves alone, then a barrier: nobody waits for ever
        assert found[rank]["evaluate_save_barrier_seconds"] < 60, found[rank]
    assert zero["evaluate"] == pytest.approx(zero["own_loss"], rel=1e-5)  # rank 0's own data, its own metrics
    x, _ = worker.data(64, seed=1)
    loaded = keras.saving.load_model(Path(directory) / "idiom_rank0.keras")
    assert loaded.predict(x[:2], verbose=0).shape == (2, 4)
    # 2. its evaluate does not wait for the others (they sleep worker.SLEEP seconds)
    assert zero["evaluate_while_others_sleep_seconds"] < worker.SLEEP / 2, zero
    # 3. a broadcast of what rank 0 computed alone, then another fit on every rank
    assert zero["broadcast"] is not None and zero["broadcast"] == one["broadcast"]
    assert zero["digest_after_second_fit"] == one["digest_after_second_fit"]
    # 4. fit on rank 0 alone against a barrier: the same clear error on every rank, at once, nothing trained
    for rank in (0, 1):
        said = found[rank]["mismatch"]
        assert said is not None and f"rank {rank}: the workers reached different calls" in said, said
        assert "rank 0 called BoostModel.fit; rank 1 called distributed.barrier()" in said, said
        assert "if rank == 0:" in said and "evaluate()" in said
        assert found[rank]["mismatch_seconds"] < 30, found[rank]
        assert found[rank]["digest_after_mismatch"] == found[rank]["digest_after_second_fit"]
    # 5. every worker's metrics over unequal shards weigh every sample alike: one process on all rows
    for rank in (0, 1):
        assert found[rank]["across"] == zero["across"]
        assert found[rank]["across"]["loss"] == pytest.approx(found[rank]["all_rows_loss"], rel=1e-5)
        assert found[rank]["across"]["accuracy"] == pytest.approx(found[rank]["all_rows_accuracy"], abs=1e-6)
    assert zero["own"]["loss"] != pytest.approx(one["own"]["loss"], rel=1e-3)  # the shards differ: not trivial


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_idioms_on_one_host(controller, tmp_path):
    check(run_ok("idioms.py", np=2, controller=controller, args=[tmp_path], timeout=300,
                 env={"KERAS_BOOST_STALL_TIMEOUT": "120"}), tmp_path)


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_idioms_across_two_hosts(controller):
    found = shared(controller, "idioms")  # across the test cluster's hosts where it can be made
    check(found, shared_dir(controller, "idioms"))


def test_barrier_and_rendezvous_in_one_process_return_at_once():
    from keras_boost import distributed

    distributed.barrier()
    assert distributed.rendezvous("anything", {"a": 1}) == [{"a": 1}]
