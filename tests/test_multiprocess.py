"""BoostModel on 2 real Horovod workers (Gloo and MPI), launched with horovodrun.

The equivalence and overflow checks are scenarios of the shared launch of their controller
(`tests.launch.shared`); the failing and killed workers end their job, so each has its own.
"""

import re
import time

import pytest

from tests.launch import horovodrun, results, shared

CONTROLLERS = ["gloo", "mpi"]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_two_workers_equal_one_process_with_twice_the_batch(controller):
    found = shared(controller, "train_equivalence")
    for rank in (0, 1):
        assert found[rank]["diff"] < 1e-5, found[rank]
    assert found[0]["digest"] == found[1]["digest"]  # bit-identical weights on every rank
    assert found[0]["history"] == found[1]["history"]
    assert found[0]["evaluation"] == found[1]["evaluation"]
    # 256 samples / (2 x 16) = 8 updates per epoch, one fused allreduce each
    assert found[0]["iterations"] == 16
    assert found[0]["collectives"] == 16
    # by default one grouped allreduce (the workers' stop votes ride in it); with
    # gradient_split_groups="each" every gradient goes to Horovod on its own, as soon as the
    # backward pass produces it, and so does the vote (one scalar more, fused by Horovod)
    ops = found[0]["horovod_ops"]
    assert ops["ops"] == {"None": {"HorovodGroupedAllreduce": 1}, "each": {"HorovodAllreduce": ops["gradients"] + 1}}, ops


def test_sparse_gradients_on_two_workers_equal_one_process_with_twice_the_batch():
    """An Embedding's IndexedSlices through Horovod, the NaN guard (with and without a loss scale) and GC "all"."""
    found = shared("gloo", "sparse_equivalence")
    for rank in (0, 1):
        assert found[rank]["moved"] > 1e-2, found[rank]  # training changed the weights
        for run in ("guard", "loss_scale"):
            assert found[rank][run]["diff"] < 1e-5, (run, found[rank])
            assert found[rank][run]["untouched_rows_moved"] > 0, (run, found[rank])  # GC moved rows without gradient
    for run in ("guard", "loss_scale"):
        assert found[0][run]["digest"] == found[1][run]["digest"]  # bit-identical weights on every rank


def test_a_callback_that_stops_one_worker_stops_every_worker_after_the_same_batch():
    """256 samples on each worker / 16 = 16 steps per epoch. A stop asked after a batch rides on
    the next update's allreduce: both workers stop after that batch (one process would stop one
    batch earlier); one asked at an epoch's end stops both right there, as in one process. The
    vote adds no collective: one per update, with one grouped allreduce or one per gradient."""
    found = shared("gloo", "stop_together")
    # run: (epochs, batches, optimizer updates)
    expected = {"rank0_mid_epoch": (2, 16 + 5, 16 + 5),  # asked after batch 3 of epoch 1, stopped after batch 4
                "rank1_epoch_end": (3, 48, 48),
                "early_stopping": (2, 32, 32),
                "rank1_mid_epoch_each": (1, 7, 7),  # asked after batch 5, stopped after batch 6
                "rank0_accumulating": (1, 4, 2),  # asked after batch 2, the update at batch 3 carried it
                "rank1_at_batch_0": (1, 1, 1)}  # asked in on_train_begin: one batch, as in one process
    for run, (epochs, batches, iterations) in expected.items():
        for rank in (0, 1):
            got = found[rank][run]
            assert (got["epochs"], got["batches"], got["iterations"]) == (epochs, batches, iterations), (run, rank, got)
            assert got["stopped"] is True, (run, got)
            assert got["collectives"] == iterations, (run, got)  # the votes ride in the gradients' collectives
        assert found[0][run]["digest"] == found[1][run]["digest"], run


# Both worker scripts train for far longer than the launcher's timeout would allow (20 and 50
# epochs of 64 steps) and print the time of the failure: the run must end within PROMPT
# seconds of it, and no rank may reach the end of fit (each reports `finished` after it). A
# hang shows up as the launcher's TimeoutExpired, a slow end as the PROMPT check.
LAUNCH_TIMEOUT, PROMPT = 300, 90


def seconds_after_failure(completed):
    """Seconds from the worker's failure (its KB_FAILURE_AT line) to the end of the run."""
    ended = time.time()
    found = re.search(r"KB_FAILURE_AT (\d+\.\d+)", completed.stdout)
    assert found, completed.stdout[-3000:]
    return ended - float(found.group(1))


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_failing_worker_ends_the_run(controller):
    completed = horovodrun("fail_on_rank.py", np=2, controller=controller, timeout=LAUNCH_TIMEOUT)
    elapsed = seconds_after_failure(completed)
    assert completed.returncode != 0
    assert "injected failure on rank 1" in completed.stdout
    assert results(completed) == {}, completed.stdout[-3000:]  # no rank finished training
    assert elapsed < PROMPT, elapsed


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_overflow_on_one_worker_is_an_overflow_on_all(controller):
    found = shared(controller, "overflow_on_one_rank")
    for rank in (0, 1):
        # step 2 of the loop is rank 1's poisoned batch (its third batch)
        assert found[rank]["overflows"] == [0, 1, 0, 0, 0, 0, 0], found[rank]
        assert found[rank]["iterations"] == [2, 2, 3, 4, 5, 6, 7]
        assert found[rank]["scales"] == [1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0, 1024.0]
        assert found[rank]["finite"]
    assert found[0]["digest"] == found[1]["digest"]


@pytest.mark.parametrize("controller, names_rank", [("mpi", "process rank 1"),
                                                    ("gloo", "Process 1 exit with status code 137")])
def test_a_killed_worker_ends_the_run_and_is_named(controller, names_rank):
    completed = horovodrun("killed_worker.py", np=2, controller=controller, timeout=LAUNCH_TIMEOUT)
    elapsed = seconds_after_failure(completed)
    assert completed.returncode != 0
    assert names_rank in completed.stdout
    assert results(completed) == {}, completed.stdout[-3000:]  # no rank finished training
    assert elapsed < PROMPT, elapsed
