"""Launches real multi-process runs under horovodrun (Gloo or MPI) with a hard timeout.

horovodrun is started as `python tests/horovodrun_main.py ...`: Horovod's own
`run_commandline()`, with its "built with Gloo / MPI?" check answered from one check per
test session instead of a TensorFlow import per launch (see that file).
"""

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


_BUILT = {}


def horovod_build_env():
    """KB_HOROVOD_GLOO_BUILT / KB_HOROVOD_MPI_BUILT for tests/horovodrun_main.py: Horovod's answers
    (`horovod.tensorflow.gloo_built()` / `mpi_built()`, which horovodrun's check calls), once per session."""
    if not _BUILT:
        import horovod.tensorflow as hvd

        _BUILT.update(KB_HOROVOD_GLOO_BUILT=str(int(bool(hvd.gloo_built()))),
                      KB_HOROVOD_MPI_BUILT=str(int(bool(hvd.mpi_built()))))
    return dict(_BUILT)


def horovodrun_command():
    """The start of a horovodrun command line (its entry point; needs `horovod_build_env()` in the environment)."""
    return [sys.executable, str(Path(__file__).resolve().parent / "horovodrun_main.py")]


def horovodrun(script, np=2, controller="gloo", args=(), timeout=240, env=None, gpus=False, hosts=None,
               launcher_args=()):
    """Runs `tests/workers/<script>` on `np` processes; returns the CompletedProcess.

    `hosts`: None runs every worker on this machine (`-H localhost:np`); a list such as
    `["kbt1:2", "kbt2:2"]` runs them on the hosts of the test cluster (tests/cluster.py),
    launched from inside the first host, as on a real cluster. The whole process group is
    killed after `timeout` seconds (and every process on the cluster's hosts), so a hung
    worker can never hang the suite; the call then raises `subprocess.TimeoutExpired`.
    `gpus=True` lets the workers see the machine's GPUs (each is pinned to its own).
    """
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    placement = ",".join(hosts) if hosts else f"localhost:{np}"
    cmd = [*horovodrun_command(), "-np", str(np), "-H", placement, f"--{controller}",
           "--start-timeout", "60", *launcher_args, sys.executable, str(WORKERS / script), *map(str, args)]
    return _launch(cmd, timeout, env, gpus, cluster=_cluster_for(hosts))


def _cluster_for(hosts):
    if not hosts:
        return None
    from tests.cluster import shared_cluster, shared_reason

    made = shared_cluster()
    if made is None:
        import pytest

        pytest.skip(f"multi-host launch needs a cluster of network namespaces: {shared_reason()}")
    return made


def results(completed):
    """The JSON objects the workers recorded with `report()`, keyed by rank."""
    found = {}
    for name in sorted(os.listdir(completed.result_dir)):
        if not (name.startswith("rank") and name.endswith(".json")):
            continue  # a file being written (`common.write_result` writes a .tmp and renames it)
        with open(os.path.join(completed.result_dir, name)) as handle:
            data = json.load(handle)
        found[data["rank"]] = data
    return found


def run_ok(script, np=2, controller="gloo", args=(), timeout=240, env=None, gpus=False, hosts=None):
    """Runs the workers, asserts a clean exit and one result per rank; returns the results."""
    completed = horovodrun(script, np=np, controller=controller, args=args, timeout=timeout, env=env, gpus=gpus,
                           hosts=hosts)
    assert completed.returncode == 0, completed.stdout[-6000:]
    found = results(completed)
    assert sorted(found) == list(range(np)), completed.stdout[-6000:]
    return found


def mpirun(script, np=2, args=(), timeout=240, env=None, gpus=False, hostfile=None):
    """Runs `tests/workers/<script>` on `np` processes with plain `mpirun` (no horovodrun).

    As under a scheduler that starts the ranks itself (`srun`, `mpirun`): Horovod finds
    its peers through MPI alone. `hostfile`: None runs them on this machine; a list of
    `(host, slots)` of the test cluster writes an Open MPI hostfile and launches from
    inside its first host. Same hard timeout and results as `horovodrun`.
    """
    placement = ["--oversubscribe"]
    if hostfile:
        path = tempfile.mktemp(prefix="kb_hostfile_")
        with open(path, "w") as handle:
            handle.write("".join(f"{host} slots={slots}\n" for host, slots in hostfile))
        # Open MPI picks the interface by itself; orted's tree spawn would ssh between hosts
        placement = ["--hostfile", path, "--mca", "plm_rsh_no_tree_spawn", "1"]
    env = dict(env or {})
    forwarded = ["PYTHONPATH", "KB_RESULT_DIR", "TF_CPP_MIN_LOG_LEVEL", "PYTHONUNBUFFERED", "PATH",
                 "KERAS_BOOST_COUNT_COLLECTIVES", *sorted(env)]
    cmd = ["mpirun", "--allow-run-as-root", *placement, "-np", str(np), "--bind-to", "none",
           *[arg for name in forwarded for arg in ("-x", name)],
           *([] if gpus else ["-x", "CUDA_VISIBLE_DEVICES"]), sys.executable, str(WORKERS / script), *map(str, args)]
    return _launch(cmd, timeout, env, gpus, cluster=_cluster_for([host for host, _ in hostfile or ()]))


def launch_env(env=None, gpus=False):
    """The environment a launcher runs in (the workers inherit it): the suite's settings, then `env`."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
                     "KERAS_BOOST_COUNT_COLLECTIVES": "1",  # tests read distributed.allreduce_count()
                     "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                     # idle MPI ranks yield the core instead of spinning (2 cores, up to 4 ranks)
                     "OMPI_MCA_mpi_yield_when_idle": "1",
                     **horovod_build_env()})
    full_env.update(_device_env(gpus))
    full_env.update(env or {})
    return full_env


def _launch(cmd, timeout, env, gpus, cluster=None):
    """Runs a launcher command in its own process group; kills the whole group after `timeout` s.

    With `cluster`, the command runs inside its first host (the cluster's ssh first on PATH),
    and a timeout also kills every process left on its hosts."""
    full_env = launch_env(env, gpus)
    result_dir = tempfile.mkdtemp(prefix="kb_results_")
    full_env["KB_RESULT_DIR"] = result_dir
    if cluster is not None:
        full_env = cluster.env(full_env)
        cmd = cluster.command(cluster.hosts[0], cmd)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc, cluster)
        out, _ = proc.communicate()
        expired = subprocess.TimeoutExpired(cmd, timeout, output=out)
        expired.result_dir = result_dir  # what the workers recorded before the timeout
        raise expired
    except BaseException:  # e.g. pytest-timeout's own limit, or Ctrl-C: no worker may outlive the test
        _kill(proc, cluster)
        raise
    if cluster is not None:
        cluster.kill_jobs()  # a worker on a host that lost its launcher
    completed = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    completed.result_dir = result_dir
    return completed


def _kill(proc, cluster):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if cluster is not None:
        cluster.kill_jobs()


# ------------------------------------------------------------------ shared launches
# Starting Horovod costs more than most checks (horovodrun and every worker import
# TensorFlow: 10-35 s on 2 shared cores). The checks that need the same launch (controller,
# number of workers) and end normally run as scenarios of one launch each
# (tests/workers/scenarios.py), started once per test session by the first test that needs
# it; each test asserts on its own scenario's results. The failure and hang tests (a worker
# that raises, is killed or stalls) end their job, so they keep launches of their own.
# Order matters: mindspore_config compiles before Horovod is initialised, so it comes first;
# dropin_rank0 ends with rank 0 evaluating alone after the other workers exit, so it comes
# last; the checks that hang when their feature breaks (uneven data, mismatched workers)
# come late, so that a hang costs the other scenarios nothing.
# KB_TESTS_SEPARATE_LAUNCHES=1 gives each scenario a launch of its own instead (the same
# workers, one scenario per launch): quicker when only a few of these tests run, as in
# scripts/mutation_check.py, and for looking at one scenario alone.
SEPARATE = os.environ.get("KB_TESTS_SEPARATE_LAUNCHES") == "1"
# The shared launches run across the hosts of the test cluster (tests/cluster.py: network
# namespaces with their own hostnames, addresses and sshd), `slots[i]` workers on host i, launched from
# inside the first host; where namespaces cannot be made (not root) they run on this
# machine alone (`-H localhost:np`) and the tests that need several hosts skip.
SHARED = {
    "gloo": dict(np=2, controller="gloo", timeout=540, slots=[1, 1], scenarios=[
        ("mindspore_config", "mindspore_config", []),
        ("topology", "topology", []),
        ("train_equivalence", "train_equivalence", []),
        ("sparse_equivalence", "sparse_equivalence", []),
        ("stop_together", "stop_together", []),
        ("overflow_on_one_rank", "overflow_on_one_rank", []),
        ("accumulation_equivalence", "accumulation_equivalence", []),
        ("freeze_training", "freeze_training", []),
        ("self_measurement", "self_measurement", []),
        ("self_measurement_gate", "self_measurement", ["gate"]),
        ("dropin_custom_step", "dropin", ["custom_step"]),
        ("dropin_jit", "dropin", ["jit"]),
        ("resume", "resume", ["{tmp}"]),
        ("adasum_training_1", "adasum_training", [1]),
        ("adasum_combine", "adasum_combine", [12]),
        ("compression", "compression", []),
        ("horovod_example", "horovod_example", []),
        ("batchnorm_stats", "batchnorm_stats", []),
        ("swa", "swa", []),
        ("uneven_data", "uneven_data", ["numpy,numpy_shuffled,dataset,pydataset"]),
        ("idioms", "idioms", ["{tmp}"]),
        ("mismatch", "mismatch", []),
        ("dropin_files", "dropin", ["files", "{tmp}/files"]),
        ("dropin_same_data", "dropin", ["same_data"]),
        ("dropin_rank0", "dropin", ["rank0", "{tmp}"]),  # last: rank 0 evaluates alone while the other exits
    ]),
    "mpi": dict(np=2, controller="mpi", timeout=480, slots=[1, 1], scenarios=[
        ("topology", "topology", []),
        ("train_equivalence", "train_equivalence", []),
        ("overflow_on_one_rank", "overflow_on_one_rank", []),
        ("accumulation_equivalence", "accumulation_equivalence", []),
        ("freeze_training", "freeze_training", []),
        ("dropin_custom_step", "dropin", ["custom_step"]),
        ("adasum_combine", "adasum_combine", [2]),
        ("horovod_example", "horovod_example", []),
        ("uneven_data", "uneven_data", ["numpy,numpy_shuffled,dataset,pydataset"]),
        ("idioms", "idioms", ["{tmp}"]),
        ("dropin_rank0", "dropin", ["rank0", "{tmp}"]),
    ]),
    "gloo4": dict(np=4, controller="gloo", timeout=420, slots=[2, 2], scenarios=[
        ("topology", "topology", []),
        ("train_equivalence", "train_equivalence", []),
        ("adasum_training_2", "adasum_training", [2]),
        ("hierarchical", "hierarchical", [2]),
    ]),
    "mpi4": dict(np=4, controller="mpi", timeout=420, slots=[2, 2], scenarios=[
        ("topology", "topology", []),
        ("train_equivalence", "train_equivalence", []),
        ("hierarchical", "hierarchical", [2]),
        ("adasum_combine", "adasum_combine", [4]),
        ("adasum_training_1", "adasum_training", [1]),
        ("adasum_training_2", "adasum_training", [2]),
    ]),
}
_SHARED_RUNS = {}


def _scenarios(launch, only=None):
    return [entry for entry in SHARED[launch]["scenarios"] if only is None or entry[0] == only]


def _run_shared(launch, only=None):
    spec = SHARED[launch]
    work = tempfile.mkdtemp(prefix=f"kb_shared_{launch}_")
    scenarios = [[name, module, [a.replace("{tmp}", work) if isinstance(a, str) else a for a in args]]
                 for name, module, args in _scenarios(launch, only)]
    from tests.cluster import shared_cluster

    made = shared_cluster() if spec.get("slots") else None
    # no namespaces here: this machine alone
    hosts = [f"{host}:{n}" for host, n in zip(made.hosts, spec["slots"])] if made is not None else None
    try:
        # a scenario that hangs in fit ends the launch after 120 s (keras_boost's stall timeout)
        # instead of at the launch's timeout; every scenario takes well under a minute
        completed = horovodrun("scenarios.py", np=spec["np"], controller=spec["controller"],
                               args=[json.dumps(scenarios)], timeout=spec["timeout"],
                               env={"KERAS_BOOST_STALL_TIMEOUT": "120"}, hosts=hosts)
    except subprocess.TimeoutExpired as expired:
        completed = subprocess.CompletedProcess(expired.cmd, f"killed after the {spec['timeout']} s timeout",
                                                expired.output, None)
        completed.result_dir = expired.result_dir
    completed.work_dir = work
    completed.hosts = hosts
    return completed, {rank: data for rank, data in results(completed).items()}


def shared(launch, scenario):
    """{rank: values} of `scenario` in the shared launch `launch` (a key of SHARED).

    The launch runs once per test session, when a test first asks for it. Asserts that
    the scenario finished without an error on every rank, and that the launch exited
    cleanly when every scenario did. The values include "scenario_seconds" (its wall time
    on that rank); `shared_dir(launch, scenario)` is the folder it wrote to.
    """
    key = (launch, scenario if SEPARATE else None)
    if key not in _SHARED_RUNS:
        _SHARED_RUNS[key] = _run_shared(*key)
    completed, found = _SHARED_RUNS[key]
    ranks = range(SHARED[launch]["np"])
    tail = f"(shared launch {launch!r}, exit {completed.returncode}):\n{completed.stdout[-6000:]}"
    missing = [rank for rank in ranks if scenario not in found.get(rank, {})]
    assert not missing, f"scenario {scenario!r} did not finish on rank(s) {missing} {tail}"
    errors = {rank: found[rank][scenario]["error"] for rank in ranks if "error" in found[rank][scenario]}
    assert not errors, f"scenario {scenario!r} raised: {errors} {tail}"
    everything_ran = all(name in found.get(rank, {}) and "error" not in found[rank][name]
                         for rank in ranks for name, _, _ in _scenarios(*key))
    if everything_ran:  # otherwise the failure is the failing scenario's test's
        assert completed.returncode == 0, f"every scenario finished, but the launch did not exit cleanly {tail}"
    return {rank: found[rank][scenario] for rank in ranks}


def shared_hosts(launch):
    """The `-H` hosts the shared launch `launch` ran on (after `shared(...)`), None on this machine alone."""
    return _SHARED_RUNS[(launch, None) if (launch, None) in _SHARED_RUNS else
                        next(key for key in _SHARED_RUNS if key[0] == launch)][0].hosts


def shared_output(launch, scenario):
    """The launch's output lines from `scenario`'s start to its end on every rank (after `shared(...)`)."""
    lines = _SHARED_RUNS[(launch, scenario if SEPARATE else None)][0].stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if f"scenarios: {scenario} starts" in line]
    ends = [i for i, line in enumerate(lines) if f"scenarios: {scenario} ends" in line]
    return lines[min(starts):max(ends) + 1]


def shared_dir(launch, scenario):
    """The folder `scenario` of `launch` got as "{tmp}" (after `shared(launch, scenario)`)."""
    return _SHARED_RUNS[(launch, scenario if SEPARATE else None)][0].work_dir
