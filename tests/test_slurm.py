"""keras_boost under a real Slurm (tests/slurm.py: slurmctld and a slurmd on each namespace host): the
documented job script on 2 and 4 hosts (srun with PMIx, Horovod on MPI), mpirun and `keras-boost train`
inside an allocation, and a job cancelled with scancel or requeued that resumes from its backup."""

import json
import os
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


@pytest.mark.parametrize("nodes", [2, 4])
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


@pytest.mark.parametrize("how", ["requeue", "scancel"])
def test_a_job_cut_short_resumes_from_its_backup(slurm, tmp_path, how):
    backup, marker, results = tmp_path / "backup", tmp_path / "marker", tmp_path / "results"
    results.mkdir()
    env = {**ENV, "KB_RESULT_DIR": str(results)}

    def submit(mode):
        return slurm.sbatch("--nodes=2", "--ntasks-per-node=1", "--requeue", f"--chdir={ROOT}",
                            f"--output={tmp_path}/job-%j.out", "--open-mode=append", "--wrap",
                            f"srun --mpi=pmix {sys.executable} {WORKERS / 'slurm_resume.py'} {mode} {backup} {marker}",
                            env=env)

    job = submit("train")
    deadline = time.monotonic() + 240
    while not marker.exists() and time.monotonic() < deadline:
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job(job)
        time.sleep(0.5)
    assert marker.exists(), [p.read_text()[-3000:] for p in tmp_path.glob("job-*.out")]
    if how == "requeue":
        assert slurm.run(["scontrol", "requeue", job]).returncode == 0
        # Slurm lets a requeued batch job start again only after a delay (its begin time): now
        deadline = time.monotonic() + 30
        while slurm.job(job).get("JobState") not in ("PENDING", "RUNNING") and time.monotonic() < deadline:
            time.sleep(0.5)
        slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    else:
        assert slurm.run(["scancel", job]).returncode == 0
        assert slurm.wait(job, timeout=60) == "CANCELLED"
        job = submit("resume")
    state = slurm.wait(job, timeout=400)
    logs = "".join(p.read_text()[-3000:] for p in tmp_path.glob("job-*.out"))
    assert state == "COMPLETED", logs
    found = {int(p.stem[4:]): json.loads(p.read_text()) for p in results.glob("rank*.json")}
    assert sorted(found) == [0, 1], logs
    for rank in (0, 1):
        assert found[rank]["epochs"] == [2, 3], found[rank]  # epochs 0 and 1 were backed up whole
        assert found[rank]["resumed"] == found[rank]["uninterrupted"]  # as if nothing had happened
