"""keras_boost inside MPI jobs it did not start: plain `mpirun` (no horovodrun) and a sub-communicator."""

import pytest

from tests.launch import mpirun, results


def run_mpi_ok(script, np, args=(), timeout=300):
    completed = mpirun(script, np=np, args=args, timeout=timeout)
    assert completed.returncode == 0, completed.stdout[-6000:]
    found = results(completed)
    assert sorted(found) == list(range(np)), completed.stdout[-6000:]
    return found


def test_plain_mpirun_trains_in_sync():
    """2 ranks started by mpirun alone equal one plain-Keras process with the 2-worker batch."""
    found = run_mpi_ok("train_equivalence.py", np=2)
    assert found[0]["digest"] == found[1]["digest"]
    assert found[0]["diff"] < 1e-5, found[0]
    assert found[0]["history"] == found[1]["history"]
    assert found[0]["iterations"] == 2 * 256 // 32  # 2 epochs of 256 rows at a global batch of 2 x 16


def test_two_of_three_ranks_train_in_a_sub_communicator():
    """distributed.init(comm=...) with an mpi4py communicator: 2 ranks train, the third does other MPI work."""
    found = run_mpi_ok("mpi_subcomm.py", np=3)
    for rank in (0, 1):
        assert found[rank]["size"] == 2 and found[rank]["hvd_rank"] == rank
        assert found[rank]["diff"] < 1e-5, found[rank]
    assert found[0]["digest"] == found[1]["digest"]
    assert found[0]["collectives"] > 0
    assert found[0]["message"] == {"from": 2, "sum": 45.0}
    assert found[2] == {"rank": 2, "horovod_initialised": False, "sub_size": 1}


@pytest.mark.parametrize("comm, match", [
    ([], "comm must be None, an mpi4py communicator or a non-empty list"),
    ([0, 0], "non-empty list of distinct non-negative world ranks, got \\[0, 0\\]"),
    ("world", "got 'world'"),
    ([0, -1], "got \\[0, -1\\]"),
])
def test_bad_comm(comm, match):
    from keras_boost import distributed

    with pytest.raises(TypeError, match=match):
        distributed.init(comm=comm)
