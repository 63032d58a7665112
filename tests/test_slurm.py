"""keras_boost under a real Slurm (tests/slurm.py: slurmctld and a slurmd on each namespace host): the
documented job script on 4 hosts (srun with PMIx, Horovod on MPI), mpirun and `keras-boost train`
inside an allocation of 2, and a job cancelled with scancel or losing a node (requeued) that resumes from its backup."""

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "slurm" / "keras-boost.sbatch"
WORKERS = ROOT / "tests" / "workers"
ENV = {"VENV": sys.prefix, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def slurm():
    from tests.slurm import shared_slurm, shared_slurm_reason

    made = shared_slurm()
    if made is None:
        pytest.skip(f"Slurm on namespace hosts cannot run here: {shared_slurm_reason()}")
    return made


def _result(path):
    """The last JSON line of a job's output (rank 0's, behind horovodrun's `[0]<stdout>:` where it launched)."""
    lines = [line[line.index("{"):] for line in Path(path).read_text().splitlines()
             if line.startswith("{") or line.startswith("[0]<stdout>:{")]
    assert lines, Path(path).read_text()[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("nodes", [4])  # 2 nodes: the tests below
def test_the_documented_job_script_trains_the_demo_across_hosts(slurm, tmp_path, nodes):
    out = tmp_path / "job.out"
    job = slurm.sbatch(f"--nodes={nodes}", f"--chdir={ROOT}", f"--output={out}", "--job-name=kb-demo",
                       f"--export=ALL,BACKUP_DIR={tmp_path}/backup", SCRIPT, "--epochs", "1", "--train-samples",
                       "4096", "--batch-size", "32", "--json", env=ENV)
    state = slurm.wait(job, timeout=400)
    assert state == "COMPLETED", out.read_text()[-4000:] if out.exists() else state
    result = _result(out)
    assert result["workers"] == nodes
    assert sorted(result["hosts"]) == sorted(slurm.cluster.hosts[:nodes])  # one worker on each host
    assert result["test_accuracy"] > 0.3, result  # it learnt (10 classes)


def test_mpirun_and_keras_boost_train_inside_an_allocation(slurm, tmp_path):
    out = tmp_path / "job.out"
    code = ("import socket; import keras_boost, tensorflow as tf; from keras_boost import distributed; "
            "distributed.init(); total = float(distributed.allreduce(tf.constant(1.0), average=False)); "
            "print(' '.join(map(str, ['MPIRUN', socket.gethostname(), distributed.rank(), distributed.size(), total])) "
            "+ chr(10), end='', flush=True)")
    wrap = (f"mpirun --allow-run-as-root {sys.executable} -c \"{code}\" && "
            f"{Path(sys.prefix) / 'bin' / 'keras-boost'} train --epochs 1 --train-samples 512 --json")
    job = slurm.sbatch("--nodes=2", "--ntasks-per-node=1", f"--chdir={ROOT}", f"--output={out}", "--wrap", wrap,
                       env=ENV)
    state = slurm.wait(job, timeout=400)
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", text[-4000:]
    ranks = sorted(line.split()[1:] for line in text.splitlines() if line.startswith("MPIRUN "))
    assert ranks == [[slurm.cluster.hosts[0], "0", "2", "2.0"], [slurm.cluster.hosts[1], "1", "2", "2.0"]], text
    assert f"keras-boost: the hosts of Slurm job {job}: {slurm.cluster.hosts[0]}:1,{slurm.cluster.hosts[1]}:1" in text
    assert sorted(_result(out)["hosts"]) == sorted(slurm.cluster.hosts[:2])


def _hostnames(slurm, nodelist):
    return slurm.run(["scontrol", "show", "hostnames", nodelist], timeout=15).stdout.split()


@pytest.mark.parametrize("how", ["scancel", "node dies"])
def test_a_job_cut_short_resumes_from_its_backup(slurm, tmp_path, how):
    """After the backup of epoch 1 the job is cancelled (`scancel`, then submitted again) or loses a
    node (its link and every process on it gone): Slurm finds the node unresponsive, fails the job,
    names the node in the job's log and requeues the job (`--requeue`) on the hosts left, where it
    resumes. Both end as if nothing had happened. (`scontrol requeue` by hand takes the same path
    as the node's requeue: SLURM_RESTART_COUNT > 0 and the backup.)"""
    backup, marker, results = tmp_path / "backup", tmp_path / "marker", tmp_path / "results"
    results.mkdir()
    env = {**ENV, "KB_RESULT_DIR": str(results)}

    def submit(mode):
        return slurm.sbatch("--nodes=2", "--ntasks-per-node=1", "--requeue", f"--chdir={ROOT}",
                            f"--output={tmp_path}/job-%j.out", "--open-mode=append", "--wrap",
                            f"srun --mpi=pmix {sys.executable} {WORKERS / 'slurm_resume.py'} {mode} {backup} {marker}",
                            env=env)

    def start_now(job):
        # Slurm lets a requeued batch job start again only after a delay (its begin time): now
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            now = slurm.job(job)
            if now.get("JobState") == "PENDING":
                slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
                return
            if int(now.get("Restarts", 0)) > 0 and now.get("JobState") in ("RUNNING", "COMPLETED"):
                return  # started again already
            time.sleep(0.5)

    job = submit("train")
    deadline = time.monotonic() + 240
    while not marker.exists() and time.monotonic() < deadline:
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job(job)
        time.sleep(0.5)
    assert marker.exists(), [p.read_text()[-3000:] for p in tmp_path.glob("job-*.out")]
    dead = None
    if how == "scancel":
        assert slurm.run(["scancel", job]).returncode == 0
        assert slurm.wait(job, timeout=60) == "CANCELLED"
        job = submit("resume")
    else:
        dead = [h for h in _hostnames(slurm, slurm.job(job)["NodeList"]) if h != slurm.controller][-1]
        slurm.kill_node(dead)
    try:
        if dead is not None:
            start_now(job)
        state = slurm.wait(job, timeout=400)
        logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("job-*.out"))
        assert state == "COMPLETED", logs
        if dead is not None:
            ran = slurm.job(job)
            assert int(ran["Restarts"]) >= 1, ran
            assert dead not in _hostnames(slurm, ran["NodeList"]), ran  # requeued on the hosts left
            assert f"Node failure on {dead}" in logs, logs  # srun names the node that died
    finally:
        if dead is not None:
            slurm.revive_node(dead)
    found = {int(p.stem[4:]): json.loads(p.read_text()) for p in results.glob("rank*.json")}
    assert sorted(found) == [0, 1], logs
    for rank in (0, 1):
        assert found[rank]["epochs"] == [2, 3], found[rank]  # epochs 0 and 1 were backed up whole
        assert found[rank]["resumed"] == found[rank]["uninterrupted"]  # as if nothing had happened
