"""Launches real multi-process runs under horovodrun (Gloo or MPI) with a hard timeout."""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def _device_env(gpus):
    """Workers run on the CPU unless `gpus`: the suite's multi-process checks need no GPU, and a
    host with fewer GPUs than workers would refuse them (one GPU per worker)."""
    return {} if gpus else {"CUDA_VISIBLE_DEVICES": ""}


def horovodrun(script, np=2, controller="gloo", args=(), timeout=240, env=None, gpus=False):
    """Runs `tests/workers/<script>` on `np` local processes; returns the CompletedProcess.

    The whole process group is killed after `timeout` seconds, so a hung worker can never
    hang the suite; the call then raises `subprocess.TimeoutExpired`. `gpus=True` lets the
    workers see the machine's GPUs (each is pinned to its own).
    """
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    horovodrun_bin = str(Path(sys.executable).parent / "horovodrun")
    cmd = [horovodrun_bin, "-np", str(np), "-H", f"localhost:{np}", f"--{controller}",
           "--start-timeout", "60", sys.executable, str(WORKERS / script), *map(str, args)]
    return _launch(cmd, timeout, env, gpus)


def results(completed):
    """The JSON objects the workers recorded with `report()`, keyed by rank."""
    found = {}
    for name in sorted(os.listdir(completed.result_dir)):
        with open(os.path.join(completed.result_dir, name)) as handle:
            data = json.load(handle)
        found[data["rank"]] = data
    return found


def run_ok(script, np=2, controller="gloo", args=(), timeout=240, env=None, gpus=False):
    """Runs the workers, asserts a clean exit and one result per rank; returns the results."""
    completed = horovodrun(script, np=np, controller=controller, args=args, timeout=timeout, env=env, gpus=gpus)
    assert completed.returncode == 0, completed.stdout[-6000:]
    found = results(completed)
    assert sorted(found) == list(range(np)), completed.stdout[-6000:]
    return found


def mpirun(script, np=2, args=(), timeout=240, env=None, gpus=False):
    """Runs `tests/workers/<script>` on `np` local processes with plain `mpirun` (no horovodrun).

    As under a scheduler that starts the ranks itself (`srun`, `mpirun`): Horovod finds
    its peers through MPI alone. Same hard timeout and results as `horovodrun`.
    """
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np), "--bind-to", "none",
           "-x", "PYTHONPATH", "-x", "KB_RESULT_DIR", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "PYTHONUNBUFFERED",
           *([] if gpus else ["-x", "CUDA_VISIBLE_DEVICES"]), sys.executable, str(WORKERS / script), *map(str, args)]
    return _launch(cmd, timeout, env, gpus)


def _launch(cmd, timeout, env, gpus):
    """Runs a launcher command in its own process group; kills the whole group after `timeout` s."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
                     "KERAS_BOOST_COUNT_COLLECTIVES": "1",  # tests read distributed.allreduce_count()
                     "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                     # idle MPI ranks yield the core instead of spinning (2 cores, up to 4 ranks)
                     "OMPI_MCA_mpi_yield_when_idle": "1"})
    full_env.update(_device_env(gpus))
    full_env.update(env or {})
    result_dir = tempfile.mkdtemp(prefix="kb_results_")
    full_env["KB_RESULT_DIR"] = result_dir
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out)
    completed = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    completed.result_dir = result_dir
    return completed
