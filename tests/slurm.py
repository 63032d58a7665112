"""A real Slurm on the hosts of the test cluster (tests/cluster.py): Debian's slurm-wlm and munge.

slurmctld runs inside the first host and one slurmd inside every host (their own hostnames,
addresses and mount namespaces), as on a cluster; jobs are submitted from inside the first
host. What a machine of namespaces needs that a real cluster has anyway:

- the cgroup hierarchies mounted inside each host's mount namespace (slurmd loads its cgroup
  plugin even with `proctrack/pgid`);
- one configuration folder per host, the same slurm.conf in each, so that every slurmd's
  PMIx gets a temporary folder of its own (`mpi.conf`'s PMIxCliTmpDirBase): the hosts share
  one /tmp, where two slurmstepds of one step would otherwise make the same folder;
- one munged for all hosts (its socket is a file, seen from every namespace).

`shared_slurm()` brings it up once per test session on the shared cluster; the cluster's
`down()` ends every daemon with its namespaces.
"""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

TOOLS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged", "munge")
CGROUPS = ("freezer", "cpuset", "memory", "devices", "pids")
_shared = {}


class SlurmError(RuntimeError):
    pass


def cannot_run_reason():
    """Why Slurm cannot run here, or None."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (./scripts/setup.sh installs slurm-wlm and munge)"
    return None


def _munge_running():
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


def start_munge():
    if _munge_running():
        return
    os.makedirs("/run/munge", exist_ok=True)
    if not os.path.exists("/etc/munge/munge.key"):
        subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
    subprocess.run(["munged", "--force"], capture_output=True)
    deadline = time.monotonic() + 10
    while not _munge_running():
        if time.monotonic() > deadline:
            raise SlurmError("munged did not start (munge -n | unmunge fails)")
        time.sleep(0.2)


class Slurm:
    """Slurm over `cluster`'s hosts; `run`, `sbatch`, `wait`, `state` from inside the first host."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.dir = Path(cluster.dir) / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.processes = []

    @property
    def controller(self):
        return self.cluster.hosts[0]

    def env(self, extra=None):
        return {"SLURM_CONF": str(self.conf), **(extra or {})}

    def _write_config(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        nodes = "\n".join(f"NodeName={h} NodeAddr={self.cluster.address(h)} CPUs={os.cpu_count()} RealMemory=1000 "
                          "State=UNKNOWN" for h in self.cluster.hosts)
        d = self.dir
        self.conf.write_text(f"""ClusterName=kbtest
SlurmctldHost={self.controller}({self.cluster.address(self.controller)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=20
JobRequeue=1
KillWait=5
MinJobAge=600
{nodes}
PartitionName=kb Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        for host in self.cluster.hosts:
            own = self.dir / f"conf-{host}"
            own.mkdir(exist_ok=True)
            shutil.copy(self.conf, own / "slurm.conf")
            (own / "mpi.conf").write_text(f"PMIxCliTmpDirBase={self.dir}/pmix-{host}\n")
            (self.dir / f"pmix-{host}").mkdir(exist_ok=True)
            (self.dir / f"spool-{host}").mkdir(exist_ok=True)

    def _mount_cgroups(self, host):
        script = ("mountpoint -q /sys/fs/cgroup/freezer && exit 0; mount -t tmpfs cgroup_root /sys/fs/cgroup; "
                  + "; ".join(f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
                              for c in CGROUPS)
                  + "; mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup "
                    "/sys/fs/cgroup/systemd")
        done = self.cluster.run(host, ["bash", "-c", script], timeout=30)
        if done.returncode != 0:
            raise SlurmError(f"cgroups could not be mounted on {host}: {done.stderr.strip()}")

    @classmethod
    def up(cls, cluster):
        slurm = cls(cluster)
        start_munge()
        slurm._write_config()
        for host in cluster.hosts:
            slurm._mount_cgroups(host)
        log = open(slurm.dir / "daemons.out", "a")
        slurm.processes.append(cluster.popen(slurm.controller, ["slurmctld", "-D", "-i"], env=slurm.env(),
                                             stdout=log, stderr=subprocess.STDOUT))
        for host in cluster.hosts:
            slurm._start_slurmd(host)
        slurm.wait_idle(len(cluster.hosts))
        return slurm

    def _start_slurmd(self, host):
        env = {"SLURM_CONF": str(self.dir / f"conf-{host}" / "slurm.conf")}
        with open(self.dir / "daemons.out", "a") as log:
            self.processes.append(self.cluster.popen(host, ["slurmd", "-D"], env=env, stdout=log,
                                                     stderr=subprocess.STDOUT))

    def kill_node(self, host):
        """`host` dies as a machine does: its link goes down first (it says goodbye to nobody), then
        every process on it ends at once (its slurmd, slurmstepds and the job's tasks) but its sshd."""
        self.cluster.link(host, up=False)
        keep = {int(self.cluster.host_pid(host))}
        found = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
        for pid in map(int, found):
            if pid not in keep:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def revive_node(self, host, timeout=60):
        """`host` boots again: link up, a new slurmd, and back in service (ReturnToService=2)."""
        self.cluster.link(host, up=True)
        self._start_slurmd(host)
        self.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"], timeout=15)
        self.wait_idle(len(self.cluster.hosts), timeout=timeout)

    def run(self, argv, timeout=60, env=None):
        return self.cluster.run(self.controller, argv, timeout=timeout, env={**self.env(), **(env or {})})

    def wait_idle(self, count, timeout=60):
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            last = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15).stdout
            if sum(line.split()[1] in ("idle", "mix", "alloc") for line in last.splitlines() if line.split()) >= count:
                return
            time.sleep(0.5)
        log = (self.dir / "daemons.out").read_text()[-3000:] if (self.dir / "daemons.out").exists() else ""
        raise SlurmError(f"Slurm's nodes did not come up in {timeout} s: {last!r}\n{log}")

    def sbatch(self, *args, env=None):
        done = self.run(["sbatch", "--parsable", *map(str, args)], timeout=30, env=env)
        if done.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(map(str, args))} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id):
        """`scontrol show job` as a dict (JobState, RunTime, NodeList, Restarts, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=15).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id, timeout, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState")
            if state in states:
                return state
            time.sleep(1)
        self.run(["scancel", str(job_id)], timeout=15)
        raise SlurmError(f"job {job_id} did not end in {timeout} s: {self.job(job_id)}")


def shared_slurm():
    """Slurm on the test session's cluster, brought up on first use; None where it cannot run."""
    if "slurm" not in _shared:
        from tests.cluster import shared_cluster, shared_reason

        cluster = shared_cluster()
        reason = shared_reason() or cannot_run_reason()
        _shared["reason"] = reason
        _shared["slurm"] = None if reason else Slurm.up(cluster)
    return _shared["slurm"]


def shared_slurm_reason():
    shared_slurm()
    return _shared["reason"]
