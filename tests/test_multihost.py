"""Training across real hosts: network namespaces with their own hostnames, addresses and sshd.

The cluster (tests/cluster.py) is made once per test session; jobs are launched from inside
its first host, as on a real cluster. The shared launches of tests/launch.py run across
its hosts (`gloo`, `mpi`: 1 worker on each of 2 hosts; `gloo4`, `mpi4`: 2 on each), so every scenario
there (equivalence to one process, overflow agreement, accumulation, freezing, AdaSum,
uneven data, mismatched workers, ...) crosses a real network; the tests here check the
placement itself and what only several hosts have: plain `mpirun` with a hostfile over
four hosts, AdaSum's groups as the hosts, and the same results as one process.
Skipped with the reason where namespaces cannot be made (not root).
"""

import json
import sys

import pytest

from tests.launch import WORKERS, _launch, horovodrun, horovodrun_command, mpirun, results, run_ok, shared, shared_hosts

SLOTS = {"gloo": [1, 1], "mpi": [1, 1], "gloo4": [2, 2], "mpi4": [2, 2]}


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
    hosts = shared_hosts(launch)
    if hosts is None:
        pytest.skip("the shared launches ran on this machine alone: no namespaces here")
    placement = [(host.split(":")[0], int(host.split(":")[1])) for host in hosts]
    assert [n for _, n in placement] == SLOTS[launch]
    check_topology(found, placement, "mpi" if launch.startswith("mpi") else "gloo")


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


# ------------------------------------------------------------------ elastic
def test_elastic_run_survives_a_host_leaving_and_takes_in_a_new_one(cluster, tmp_path):
    """horovodrun's elastic mode across hosts with a host discovery script: host 2 leaves the
    host list mid-run (rank 0 rewrites the file), rank 0 trains alone, then host 3 is added and
    its worker joins; the run finishes every epoch with the weights of exactly the committed
    batches (a plain Keras model replaying them), bit-identical on both workers."""
    first, leaving, joining = cluster.hosts[:3]
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"{first}:1\n{leaving}:1\n")
    plan = {"hosts": str(hosts_file), "remove_at": 10, "after_remove": f"{first}:1\n",
            "after_wait": f"{first}:1\n{joining}:1\n"}
    env = {"KB_ELASTIC_HOSTS": str(hosts_file), "KB_ELASTIC_PLAN": json.dumps(plan),
           "KB_ELASTIC_MARKER": str(tmp_path / "removed"), "KB_ELASTIC_EPOCHS": "4", "KB_ELASTIC_KILL_AT": "0",
           "KB_ELASTIC_ALONE": "6", "KB_ELASTIC_WAIT_S": "90",
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60", "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
    cmd = [*horovodrun_command(), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", f"sh {WORKERS / 'elastic_discover.sh'}", "--gloo", "--start-timeout", "60",
           "--elastic-timeout", "60", sys.executable, str(WORKERS / "elastic_train.py")]
    completed = _launch(cmd, 240, env, False, cluster=cluster)
    out = completed.stdout[-6000:]
    assert completed.returncode == 0, out
    assert f"rank 0 sets the hosts to ['{first}:1']" in completed.stdout, out
    found = results(completed)
    assert sorted(found) == [0, 1], out  # host 3's worker joined: two at the end
    assert (found[0]["hostname"], found[1]["hostname"]) == (first, joining), found
    assert not found[0]["joined_late"] and found[1]["joined_late"]
    for rank in (0, 1):
        assert found[rank]["epochs"] == 4 and found[rank]["size"] == 2
        assert found[rank]["reference_diff"] < 1e-4, found[rank]  # nothing lost twice, nothing applied twice
    assert found[0]["digest"] == found[1]["digest"]  # weights and optimizer state bit-identical
    assert found[0]["log"] == found[1]["log"]
    assert {samples for _, samples in found[0]["log"]} == {16, 32}  # trained alone and with two hosts


# ------------------------------------------------------------------ files
def test_a_backup_on_the_first_hosts_disk_alone_resumes_every_host(cluster, tmp_path):
    """Hosts with disks of their own: the backup folder is hidden on host 2 (an empty folder of its
    own, bind-mounted there), so only rank 0's host has the backup. Keras' own BackupAndRestore,
    given on both workers as in a script written for one machine, runs as keras_boost's: rank 0
    writes it, and on the relaunch reads it and sends it to rank 1, so both resume at epoch 2, to
    exactly the weights of an uninterrupted run; the CSV log has one row per epoch."""
    backup, out = tmp_path / "backup", tmp_path / "out"
    backup.mkdir()
    out.mkdir()
    hosts = [f"{host}:1" for host in cluster.hosts[:2]]
    env = {"KERAS_BOOST_STALL_TIMEOUT": "30"}  # ranks resuming apart would stall: end it soon
    with cluster.shadow(cluster.hosts[1], backup):
        trained = run_ok("local_backup.py", np=2, args=["train", backup, out], timeout=240, env=env, hosts=hosts)
        assert (backup / "latest.weights.h5").exists()
        found = run_ok("local_backup.py", np=2, args=["resume", backup, out], timeout=240, env=env, hosts=hosts)
    assert [trained[rank]["epochs"] for rank in (0, 1)] == [[0, 1], [0, 1]]
    assert (found[0]["sees_backup"], found[1]["sees_backup"]) == (True, False)  # host 2 has no copy
    for rank in (0, 1):
        assert found[rank]["epochs"] == [2, 3], found[rank]  # epochs 0 and 1 were backed up
        assert found[rank]["resumed"] == found[rank]["uninterrupted"]  # bit-identical to no stop at all
    assert found[0]["resumed"] == found[1]["resumed"]
    rows = (out / "log.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in rows] == ["epoch", "0", "1", "2", "3"], rows
    assert not backup.exists() or not list(backup.iterdir())  # the resumed run deleted it at its end


# ------------------------------------------------------------------ faults
@pytest.mark.parametrize("stall", [20, 600])
def test_a_host_that_drops_off_ends_the_job_and_a_relaunch_resumes(cluster, tmp_path, stall):
    """Host 2's link goes down mid-run (after the backup of epoch 1): the Gloo job ends within the
    stall bound with an error naming rank 1 and its host, leaves only whole backups, and a relaunch
    with the link up resumes at epoch 2 to exactly the weights of an uninterrupted run. With the
    default stall timeout (600 s) Gloo's own 30 s timeout ends the job first: the surviving worker
    still names the rank and host it lost."""
    import threading
    import time

    backup, marker = tmp_path / "backup", tmp_path / "link"
    hosts, lost = [f"{host}:1" for host in cluster.hosts[:2]], cluster.hosts[1]
    env = {"KB_LINK_MARKER": str(marker), "KERAS_BOOST_STALL_TIMEOUT": str(stall)}
    down_at = {}

    def take_the_link_down():
        deadline = time.monotonic() + 200
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if marker.exists():
            cluster.link(lost, up=False)
            down_at["time"] = time.time()
            (tmp_path / "link.down").write_text("down")

    cutter = threading.Thread(target=take_the_link_down, daemon=True)
    cutter.start()
    try:
        completed = horovodrun("host_lost.py", np=2, controller="gloo", args=["train", backup], timeout=240, env=env,
                               hosts=hosts)
    finally:
        cutter.join(timeout=5)
        cluster.link(lost, up=True)
    ended = time.time()
    out = completed.stdout
    assert completed.returncode != 0, out[-6000:]
    assert "time" in down_at, out[-6000:]
    assert results(completed) == {}, out[-6000:]  # no rank finished training
    assert f"nothing heard from rank 1 on {lost}" in out, out[-6000:]
    if stall == 600:  # Gloo's timeout ended it: the surviving rank 0 says what it lost and what to do
        assert f"keras_boost: lost: rank 0 of 2 on {cluster.hosts[0]}: a collective of fit was abandoned" in out
        assert "relaunch the same command" in out
    # the stall bound (or Gloo's 30 s), the heartbeat that names the silent host and the launcher's own end
    assert ended - down_at["time"] < min(stall, 30) + 45, ended - down_at["time"]
    # only whole files in the backup folder: BackupAndRestore writes a temporary file and renames it
    assert not [p for p in backup.rglob("*") if p.is_file() and (".tmp" in p.name or p.stat().st_size == 0)]

    cluster.wait_ssh(lost)
    found = run_ok("host_lost.py", np=2, controller="gloo", args=["resume", backup], timeout=240, hosts=hosts)
    for rank in (0, 1):
        assert found[rank]["epochs"] == [2, 3], found[rank]  # epochs 0 and 1 were backed up whole
        assert found[rank]["resumed"] == found[rank]["uninterrupted"]  # bit-identical to no fault at all
    assert found[0]["resumed"] == found[1]["resumed"]


def test_a_host_that_drops_off_under_mpi_is_named_by_the_workers_and_the_launcher(cluster, tmp_path):
    """`keras-boost train --controller mpi` on two hosts; host 2's link goes down in epoch 2. Under
    MPI there is no launcher store: rank 0 serves one, so the surviving worker's watchdog names
    rank 1 and its host, and the launcher ends the job (mpirun would wait for the lost host's
    daemon) within seconds of that line, repeating it with the command to relaunch."""
    import subprocess
    import time
    from pathlib import Path

    from tests.launch import _kill, launch_env

    first, lost = cluster.hosts[:2]
    log = tmp_path / "job.log"
    command = cluster.command(first, [Path(sys.prefix) / "bin" / "keras-boost", "train", "--hosts",
                                      f"{first}:1,{lost}:1", "--controller", "mpi", "--epochs", "30",
                                      "--train-samples", "4096", "--batch-size", "32"])
    env = cluster.env(launch_env({"KERAS_BOOST_STALL_TIMEOUT": "10"}))
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while "Epoch 2/" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert "Epoch 2/" in log.read_text(), log.read_text()[-4000:]
        time.sleep(3)
        cluster.link(lost, up=False)
        down = time.monotonic()
        status = proc.wait(timeout=150)
        took = time.monotonic() - down
    finally:
        cluster.link(lost, up=True)
        _kill(proc, cluster)
    text = log.read_text()
    assert status != 0, text[-4000:]
    workers = [line for line in text.splitlines() if "keras_boost: stall: nothing heard from rank 1 on" in line]
    assert workers and f"rank 1 on {lost}" in workers[0], text[-4000:]
    summary = text[text.rindex("keras-boost: the job ended with status"):]
    assert f"nothing heard from rank 1 on {lost}" in summary and "keras-boost: to go on, relaunch:" in summary, summary
    # the watchdog (stall 10 s, plus Horovod's check period and 5 s under MPI), the launcher's NAMED_GRACE
    # and mpirun's end, on a loaded machine
    assert took < 10 + 10 + 10 + 25, (took, text[-4000:])
    cluster.wait_ssh(lost)
