"""A cluster of real hosts on one machine: network namespaces on a bridge, each with its own
hostname, address and sshd.

    python -m tests.cluster up 4 [--rate 100mbit]    # hosts kbh1..kbh4, 10.213.0.1..4
    python -m tests.cluster run kbh1 -- horovodrun -np 2 -H kbh1:1,kbh2:1 python train.py
    python -m tests.cluster down

(`scripts/cluster.sh` is the same command.) Needs root (namespaces, veth, sshd) and
Debian's `openssh-server` and `iproute2` (`scripts/setup.sh` installs both).

What a host is:
- a network namespace `kbhI` whose `eth0` is one end of a veth pair; the other end sits on
  the bridge `kbbr0` inside a namespace of its own (`kbsw`, the switch), so the cluster's
  addresses exist only inside these namespaces: the machine's own namespace has no
  route to them and nothing leaves the machine;
- its own hostname (a UTS namespace, `hostname kbhI`), set by the process that then runs
  the host's sshd; everything that sshd starts (a login, horovodrun's workers, Open MPI's
  orted) runs in that host's network, UTS and mount namespaces;
- its own `/etc/hosts` (`ip netns exec` bind-mounts `/etc/netns/kbhI/hosts`), naming every
  host of the cluster by its address; the machine's own `/etc/hosts` is not touched.
  `up(..., hosts_lines={...})` plants other lines for a host (a hostname that resolves to
  a loopback address, say);
- links limited to `rate` in both directions with `tc qdisc ... tbf` (the host's `eth0`
  and the switch's side of the veth), when asked.

The file system is shared: every host sees the same repository, venv and /tmp, as on a
cluster with a shared home. ssh between hosts logs in as root with the cluster's own key;
a `ssh` wrapper in `<dir>/bin` (first on PATH in `run`) passes the cluster's client
configuration, so neither `~/.ssh` nor `/etc/ssh` is changed.

Jobs are launched from inside a host (`run("kbh1", ...)`), as on a real cluster where the
launcher is a node that the workers can reach.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "kbh"
SWITCH = "kbsw"
BRIDGE = "kbbr0"
SUBNET = "10.213.0"
DEFAULT_DIR = Path("/tmp/keras_boost_cluster")
NETNS_ETC = Path("/etc/netns")


class ClusterError(RuntimeError):
    pass


def _sh(*cmd, check=True, capture=True, timeout=60):
    completed = subprocess.run(list(map(str, cmd)), capture_output=capture, text=True, timeout=timeout)
    if check and completed.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, cmd))} failed ({completed.returncode}): "
                           f"{(completed.stderr or '').strip()}")
    return completed


def host_name(index):
    return f"{PREFIX}{index}"


def host_address(index):
    return f"{SUBNET}.{index}"


def cannot_make_reason():
    """Why a cluster cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (the suite runs as root on CI)"
    for tool in ("ip", "tc", "unshare", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (./scripts/setup.sh installs iproute2 and openssh-server)"
    if not Path("/usr/sbin/sshd").exists():
        return "/usr/sbin/sshd is missing (./scripts/setup.sh installs openssh-server)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    """A running cluster (see the module docstring). Use `Cluster.up(n)`; `down()` always."""

    def __init__(self, n, directory, rate=None, pids=None):
        self.n = n
        self.dir = Path(directory)
        self.rate = rate
        self.pids = pids or {}

    # ------------------------------------------------------------ naming
    @property
    def hosts(self):
        return [host_name(i) for i in range(1, self.n + 1)]

    def address(self, host):
        return host_address(int(host[len(PREFIX):]))

    @property
    def bin_dir(self):
        return self.dir / "bin"

    @property
    def key(self):
        return self.dir / "id_ed25519"

    @property
    def ssh_config(self):
        return self.dir / "ssh_config"

    def env(self, extra=None):
        """The environment of a command run on a host: the cluster's ssh first on PATH."""
        env = dict(os.environ)
        env.update(extra or {})
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    # ------------------------------------------------------------ making
    @classmethod
    def up(cls, n, directory=DEFAULT_DIR, rate=None, hosts_lines=None):
        """Makes hosts kbh1..kbhn (after removing any left from an earlier run)."""
        if not 1 <= n <= 16:
            raise ValueError(f"`n` must be 1..16 hosts, got {n!r}")
        reason = cannot_make_reason()
        if reason:
            raise ClusterError(reason)
        down(directory)
        cluster = cls(n, directory, rate)
        try:
            cluster._make(hosts_lines or {})
        except BaseException:
            cluster.down()
            raise
        return cluster

    def _make(self, hosts_lines):
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bin_dir.mkdir(exist_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.dir / "host_key")
        shutil.copy(f"{self.key}.pub", self.dir / "authorized_keys")
        self.ssh_config.write_text(
            "Host *\n"
            f"  IdentityFile {self.key}\n"
            "  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n"
            "  BatchMode yes\n"
            "  ConnectTimeout 10\n"
            "  ServerAliveInterval 5\n"
            "  ServerAliveCountMax 3\n")
        wrapper = self.bin_dir / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {self.ssh_config} \"$@\"\n")
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)

        _sh("ip", "netns", "add", SWITCH)
        _sh("ip", "netns", "exec", SWITCH, "ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "netns", "exec", SWITCH, "ip", "link", "set", BRIDGE, "up")
        for index, host in enumerate(self.hosts, start=1):
            self._make_host(index, host, hosts_lines.get(host))
        self._write_state()
        for host in self.hosts:  # every sshd answers before `up` returns
            self.wait_ssh(host)

    def _make_host(self, index, host, extra_lines):
        outside = f"kbv{index}"
        _sh("ip", "netns", "add", host)
        _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", f"{host}e")
        _sh("ip", "link", "set", outside, "netns", SWITCH)
        _sh("ip", "link", "set", f"{host}e", "netns", host)
        _sh("ip", "netns", "exec", host, "ip", "link", "set", f"{host}e", "name", "eth0")
        _sh("ip", "netns", "exec", host, "ip", "addr", "add", f"{host_address(index)}/24", "dev", "eth0")
        _sh("ip", "netns", "exec", host, "ip", "link", "set", "eth0", "up")
        _sh("ip", "netns", "exec", host, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", SWITCH, "ip", "link", "set", outside, "master", BRIDGE)
        _sh("ip", "netns", "exec", SWITCH, "ip", "link", "set", outside, "up")
        if self.rate:
            for ns, dev in ((host, "eth0"), (SWITCH, outside)):
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                    "burst", "256kbit", "latency", "200ms")
        etc = NETNS_ETC / host
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{host_address(i)} {host_name(i)}" for i in range(1, self.n + 1)]
        if extra_lines:
            lines = list(extra_lines) + lines  # first match wins: a planted line shadows the real one
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        config = self.dir / f"sshd_{host}.conf"
        config.write_text(
            f"ListenAddress {host_address(index)}\n"
            "Port 22\n"
            f"HostKey {self.dir / 'host_key'}\n"
            f"PidFile {self.dir / f'sshd_{host}.pid'}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "MaxStartups 100:30:200\n"
            "MaxSessions 100\n"
            "LogLevel ERROR\n"
            "PrintMotd no\n")
        log = open(self.dir / f"sshd_{host}.log", "w")
        # The host's own hostname: a UTS namespace whose first process sets it and then
        # becomes the host's sshd, so every login and every process it starts has it.
        proc = subprocess.Popen(["ip", "netns", "exec", host, "unshare", "--uts", "sh", "-c",
                                 f"hostname {host} && exec /usr/sbin/sshd -D -e -f {config}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pids[host] = proc.pid

    def _write_state(self):
        (self.dir / "cluster.json").write_text(json.dumps(
            {"n": self.n, "rate": self.rate, "pids": self.pids}))

    @classmethod
    def load(cls, directory=DEFAULT_DIR):
        """The cluster that `up` left in `directory` (for the command line's `run`)."""
        state = json.loads((Path(directory) / "cluster.json").read_text())
        return cls(state["n"], directory, state["rate"], state["pids"])

    # ------------------------------------------------------------ using
    def host_pid(self, host):
        """A process in the host's namespaces (its sshd, whose parent shell exec'd it)."""
        return self.pids[host]

    def command(self, host, argv):
        """`argv` as run inside `host`: its network, hostname and /etc/hosts."""
        return ["nsenter", "-t", str(self.host_pid(host)), "-n", "-u", "-m", "--", *map(str, argv)]

    def run(self, host, argv, timeout=60, env=None, check=False, **kwargs):
        return subprocess.run(self.command(host, argv), env=self.env(env), timeout=timeout, text=True,
                              capture_output=True, check=check, **kwargs)

    def popen(self, host, argv, env=None, **kwargs):
        return subprocess.Popen(self.command(host, argv), env=self.env(env), text=True, **kwargs)

    def wait_ssh(self, host, timeout=20):
        """Waits until `host`'s sshd takes a login (from host 1's namespace)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.pids.get(host) and not Path(f"/proc/{self.pids[host]}").exists():
                log = (self.dir / f"sshd_{host}.log").read_text()
                raise ClusterError(f"sshd of {host} exited: {log.strip()}")
            probe = self.run(self.hosts[0], ["ssh", host, "hostname"], timeout=15)
            if probe.returncode == 0 and probe.stdout.strip() == host:
                return
            last = (probe.stdout + probe.stderr).strip()
            time.sleep(0.3)
        raise ClusterError(f"ssh to {host} did not answer in {timeout} s: {last}")

    def link(self, host, up):
        """Takes `host`'s link to the switch down (`up=False`: the host drops off) or up again."""
        index = int(host[len(PREFIX):])
        _sh("ip", "netns", "exec", SWITCH, "ip", "link", "set", f"kbv{index}", "up" if up else "down")

    def kill_jobs(self):
        """Kills every process on every host but its sshd (a launch's leftovers after a timeout)."""
        keep = {int(pid) for pid in self.pids.values()}
        for host in self.hosts:
            found = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
            for pid in found:
                if int(pid) not in keep:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def down(self):
        down(self.dir)


# ------------------------------------------------------------------ one per test session
SHARED_SIZE = 4
_shared = {}


def shared_cluster():
    """The test session's cluster of SHARED_SIZE hosts, made on first use; None (with the
    reason in `shared_reason()`) where namespaces cannot be made. `shutdown_shared()` removes it."""
    if "cluster" not in _shared:
        reason = cannot_make_reason()
        _shared["reason"] = reason
        _shared["cluster"] = None if reason else Cluster.up(SHARED_SIZE)
    return _shared["cluster"]


def shared_reason():
    shared_cluster()
    return _shared["reason"]


def shutdown_shared():
    made = _shared.pop("cluster", None)
    if made is not None:
        made.down()


def down(directory=DEFAULT_DIR):
    """Removes every host, the switch and their files; safe to call when nothing is up."""
    directory = Path(directory)
    state_file = directory / "cluster.json"
    pids = {}
    if state_file.exists():
        try:
            pids = json.loads(state_file.read_text()).get("pids", {})
        except ValueError:
            pids = {}
    for pid in pids.values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    names = [line.split()[0] for line in listing if line.strip()]
    for name in names:
        if name == SWITCH or (name.startswith(PREFIX) and name[len(PREFIX):].isdigit()):
            # every process still in the namespace (workers, logins) goes with it
            pids_in = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids_in:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    if directory.exists():
        shutil.rmtree(directory, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="make N hosts (removing earlier ones)")
    up_parser.add_argument("n", type=int)
    up_parser.add_argument("--rate", default=None, help="limit every link to RATE (tc units: 1gbit, 100mbit)")
    up_parser.add_argument("--dir", default=str(DEFAULT_DIR))
    down_parser = sub.add_parser("down", help="remove the hosts")
    down_parser.add_argument("--dir", default=str(DEFAULT_DIR))
    run_parser = sub.add_parser("run", help="run a command inside a host: run HOST -- CMD...")
    run_parser.add_argument("host")
    run_parser.add_argument("argv", nargs=argparse.REMAINDER)
    run_parser.add_argument("--dir", default=str(DEFAULT_DIR))
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = Cluster.up(args.n, args.dir, rate=args.rate)
        for host in cluster.hosts:
            print(f"{host} {cluster.address(host)}")
        print(f"run a command on a host: {sys.argv[0]} run {cluster.hosts[0]} -- CMD")
        return 0
    if args.command == "down":
        down(args.dir)
        return 0
    cluster = Cluster.load(args.dir)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    proc = cluster.popen(args.host, argv or ["bash"])
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
