"""Training across real hosts: network namespaces with their own hostnames, addresses and sshd.

The cluster (tests/cluster.py) is made once per test session; jobs are launched from inside
its first host, as on a real cluster. The shared launches of tests/launch.py run across
its hosts (`gloo`, `mpi`: kbh1:1,kbh2:1; `gloo4`, `mpi4`: kbh1:2,kbh2:2), so every scenario
there (equivalence to one process, overflow agreement, accumulation, freezing, AdaSum,
uneven data, mismatched workers, ...) crosses a real network; the tests here check the
placement itself and what only several hosts have: plain `mpirun` with a hostfile over
four hosts, AdaSum's groups as the hosts, and the same results as one process.
Skipped with the reason where namespaces cannot be made (not root).
"""

import json

import pytest

from tests.launch import mpirun, results, shared, shared_hosts

PLACEMENTS = {"gloo": [("kbh1", 1), ("kbh2", 1)], "mpi": [("kbh1", 1), ("kbh2", 1)],
              "gloo4": [("kbh1", 2), ("kbh2", 2)], "mpi4": [("kbh1", 2), ("kbh2", 2)]}


def expected_topology(placement):
    """{rank: (host, local_rank, local_size, cross_rank, cross_size)} for ranks filled host by host."""
    expected, rank = {}, 0
    for cross_rank, (host, slots) in enumerate(placement):
        for local_rank in range(slots):
            # cross_rank counts the hosts that have a worker of this local_rank (all, when homogeneous)
            cross_size = sum(1 for _, s in placement if s > local_rank)
            expected[rank] = (host, local_rank, slots, cross_rank, cross_size)
            rank += 1
    return expected


def check_topology(found, placement, controller):
    expected = expected_topology(placement)
    assert sorted(found) == sorted(expected)
    names = [expected[rank][0] for rank in sorted(expected)]
    for rank, (host, local_rank, local_size, cross_rank, cross_size) in expected.items():
        seen = found[rank]
        assert (seen["hostname"], seen["local_rank"], seen["local_size"], seen["cross_rank"], seen["cross_size"]) \
            == (host, local_rank, local_size, cross_rank, cross_size), seen
        assert seen["size"] == len(expected) and seen["controller"] == controller
        assert seen["hosts_by_rank"] == names  # an allgather across the hosts
        assert not seen["address"].startswith("127."), seen  # each host is reached on its own address
    assert len({found[r]["address"] for r in found}) == len(placement)


@pytest.mark.parametrize("launch", ["gloo", "mpi", "gloo4", "mpi4"])
def test_workers_run_on_the_hosts_asked_for(launch):
    found = shared(launch, "topology")
    if shared_hosts(launch) is None:
        pytest.skip("the shared launches ran on this machine alone: no namespaces here")
    check_topology(found, PLACEMENTS[launch], "mpi" if launch.startswith("mpi") else "gloo")


@pytest.mark.parametrize("launch", ["gloo4", "mpi4"])
def test_four_workers_on_two_hosts_equal_one_process_with_the_global_batch(launch):
    found = shared(launch, "train_equivalence")
    for rank in range(4):
        # same data and order; float32 sums in another order (4 x 16 rows averaged across hosts
        # against one batch of 64): equal within rounding, not bit for bit
        assert found[rank]["diff"] < 1e-5, found[rank]
        assert found[rank]["digest"] == found[0]["digest"]  # bit-identical on every rank, every host
        assert found[rank]["history"] == found[0]["history"]
    # 256 samples / (4 x 16) = 4 updates per epoch, one fused allreduce each
    assert found[0]["iterations"] == 8 and found[0]["collectives"] == 8


def test_adasum_groups_are_the_hosts():
    """device_number = workers per host: averaging inside a host, AdaSum across the two hosts."""
    topology = shared("mpi4", "topology")
    found = shared("mpi4", "adasum_training_2")
    if shared_hosts("mpi4") is not None:
        # AdaSum's groups are consecutive ranks of device_number: exactly each host's workers
        for rank in range(4):
            assert topology[rank]["hostname"] == topology[(rank // 2) * 2]["hostname"]
        assert topology[0]["hostname"] != topology[2]["hostname"]
    for rank in range(4):
        assert found[rank]["groups"] == 2
        assert found[rank]["step_diff"] < 1e-5, found[rank]  # against the NumPy rule (adasum_tree)


def test_plain_mpirun_with_a_hostfile_over_four_hosts(cluster):
    """Open MPI starts the ranks itself from a hostfile (as a scheduler does): one per host."""
    hostfile = [(host, 1) for host in cluster.hosts[:4]]
    scenarios = [["topology", "topology", []], ["train_equivalence", "train_equivalence", []]]
    completed = mpirun("scenarios.py", np=4, args=[json.dumps(scenarios)], timeout=300, hostfile=hostfile)
    assert completed.returncode == 0, completed.stdout[-6000:]
    found = results(completed)
    assert sorted(found) == [0, 1, 2, 3], completed.stdout[-6000:]
    for rank in range(4):
        assert "error" not in found[rank]["topology"] and "error" not in found[rank]["train_equivalence"], found[rank]
    check_topology({rank: found[rank]["topology"] for rank in found}, hostfile, "mpi")
    equivalence = {rank: found[rank]["train_equivalence"] for rank in found}
    for rank in range(4):
        assert equivalence[rank]["diff"] < 1e-5, equivalence[rank]
        assert equivalence[rank]["digest"] == equivalence[0]["digest"]
    assert equivalence[0]["iterations"] == 8
