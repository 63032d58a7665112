"""A cluster of real hosts on one machine: network namespaces on a bridge, each with its own
hostname, address and sshd.

    python -m tests.cluster up 4 [--rate 100mbit]    # hosts kbh1..kbh4, 10.213.0.1..4
    python -m tests.cluster run kbh1 -- horovodrun -np 2 -H kbh1:1,kbh2:1 python train.py
    python -m tests.cluster down

Several clusters can exist at once, each under its own name prefix (`kbh`, the command
line's default: kbh1, kbh2, ...). A test session (`shared_cluster()`) or a benchmark takes
the first free prefix of `SESSION_PREFIXES` (kbt1.., kbu1.., ...) and holds its lock file
for as long as its cluster lives, so two test sessions (the suite and a mutation check,
say) never tear down each other's hosts; code must use `cluster.hosts`, not fixed names.

(`scripts/cluster.sh` is the same command.) Needs root (namespaces, veth, sshd) and
Debian's `openssh-server` and `iproute2` (`scripts/setup.sh` installs both).

What a host is:
- a network namespace `kbhI` whose `eth0` is one end of a veth pair; the other end sits on
  the bridge `br0` inside a namespace of its own (`kbhsw`, the switch), so the cluster's
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
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "kbh"  # the command line's cluster
SESSION_PREFIXES = ("kbt", "kbu", "kbv", "kbw", "kbx", "kby")  # test sessions and benchmarks: the first free one
ALL_PREFIXES = (PREFIX, *SESSION_PREFIXES)
BRIDGE = "br0"  # inside the switch's namespace: one per cluster without a clash
NETNS_ETC = Path("/etc/netns")


def directory_for(prefix):
    return Path(f"/tmp/keras_boost_cluster_{prefix}")


def subnet_for(prefix):
    return f"10.213.{ALL_PREFIXES.index(prefix) if prefix in ALL_PREFIXES else 99}"


class ClusterError(RuntimeError):
    pass


def _sh(*cmd, check=True, capture=True, timeout=60):
    completed = subprocess.run(list(map(str, cmd)), capture_output=capture, text=True, timeout=timeout)
    if check and completed.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, cmd))} failed ({completed.returncode}): "
                           f"{(completed.stderr or '').strip()}")
    return completed


def cannot_make_reason():
    """Why a cluster cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (the suite runs as root on CI)"
    for tool in ("ip", "tc", "unshare", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (./scripts/setup.sh installs iproute2 and openssh-server)"
    if not Path("/usr/sbin/sshd").exists():
        return "/usr/sbin/sshd is missing (./scripts/setup.sh installs openssh-server)"
    probe = f"kbprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    """A running cluster (see the module docstring). Use `Cluster.up(n)`; `down()` always."""

    def __init__(self, n, prefix=PREFIX, rate=None, pids=None, lock=None):
        self.n = n
        self.prefix = prefix
        self.dir = directory_for(prefix)
        self.rate = rate
        self.pids = pids or {}
        self._lock = lock  # the open lock file of a session's prefix

    # ------------------------------------------------------------ naming
    @property
    def hosts(self):
        return [self.host_name(i) for i in range(1, self.n + 1)]

    def host_name(self, index):
        return f"{self.prefix}{index}"

    def host_address(self, index):
        return f"{subnet_for(self.prefix)}.{index}"

    def index(self, host):
        if not (host.startswith(self.prefix) and host[len(self.prefix):].isdigit()):
            raise ValueError(f"`host` must be one of {self.hosts}, got {host!r}")
        return int(host[len(self.prefix):])

    def address(self, host):
        return self.host_address(self.index(host))

    @property
    def switch(self):
        return f"{self.prefix}sw"

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
    def up(cls, n, prefix=None, rate=None, hosts_lines=None):
        """Makes hosts <prefix>1..<prefix>n (after removing any left under that prefix).

        `prefix` None takes the first of SESSION_PREFIXES whose lock no other process holds,
        and holds it until `down()` (or this process ends)."""
        if not 1 <= n <= 16:
            raise ValueError(f"`n` must be 1..16 hosts, got {n!r}")
        reason = cannot_make_reason()
        if reason:
            raise ClusterError(reason)
        lock = None
        if prefix is None:
            prefix, lock = _take_a_prefix()
        down(prefix)
        cluster = cls(n, prefix, rate, lock=lock)
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
            "  ServerAliveInterval 15\n"
            "  ServerAliveCountMax 4\n")
        wrapper = self.bin_dir / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {self.ssh_config} \"$@\"\n")
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)

        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "netns", "exec", self.switch, "ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "netns", "exec", self.switch, "ip", "link", "set", BRIDGE, "up")
        for index, host in enumerate(self.hosts, start=1):
            self._make_host(index, host, hosts_lines.get(host))
        self._write_state()
        for host in self.hosts:  # every sshd answers before `up` returns
            self.wait_ssh(host)

    def _make_host(self, index, host, extra_lines):
        outside = f"{host}v"  # the switch's end (made in this namespace, so named uniquely)
        _sh("ip", "netns", "add", host)
        _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", f"{host}e")
        _sh("ip", "link", "set", outside, "netns", self.switch)
        _sh("ip", "link", "set", f"{host}e", "netns", host)
        _sh("ip", "netns", "exec", host, "ip", "link", "set", f"{host}e", "name", "eth0")
        _sh("ip", "netns", "exec", host, "ip", "addr", "add", f"{self.host_address(index)}/24", "dev", "eth0")
        _sh("ip", "netns", "exec", host, "ip", "link", "set", "eth0", "up")
        _sh("ip", "netns", "exec", host, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", self.switch, "ip", "link", "set", outside, "master", BRIDGE)
        _sh("ip", "netns", "exec", self.switch, "ip", "link", "set", outside, "up")
        if self.rate:
            for ns, dev in ((host, "eth0"), (self.switch, outside)):
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                    "burst", "256kbit", "latency", "200ms")
        etc = NETNS_ETC / host
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("\n".join(list(extra_lines or []) + self._hosts_lines()) + "\n")
        config = self.dir / f"sshd_{host}.conf"
        config.write_text(
            f"ListenAddress {self.host_address(index)}\n"
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

    def _hosts_lines(self):
        """The usual /etc/hosts of a host: localhost and every host of the cluster by its address."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        return lines + [f"{self.host_address(i)} {self.host_name(i)}" for i in range(1, self.n + 1)]

    def _write_state(self):
        (self.dir / "cluster.json").write_text(json.dumps(
            {"n": self.n, "prefix": self.prefix, "rate": self.rate, "pids": self.pids}))

    @classmethod
    def load(cls, prefix=PREFIX):
        """The cluster that `up` left under `prefix` (for the command line's `run`)."""
        state = json.loads((directory_for(prefix) / "cluster.json").read_text())
        return cls(state["n"], prefix, state["rate"], state["pids"])

    # ------------------------------------------------------------ using
    def host_pid(self, host):
        """A process in the host's namespaces (its sshd, whose parent shell exec'd it)."""
        return self.pids[host]

    def command(self, host, argv, cwd=None):
        """`argv` as run inside `host`: its network, hostname and /etc/hosts (in folder `cwd`, else /)."""
        wd = [f"--wd={cwd}"] if cwd else []
        return ["nsenter", "-t", str(self.host_pid(host)), "-n", "-u", "-m", *wd, "--", *map(str, argv)]

    def run(self, host, argv, timeout=60, env=None, check=False, **kwargs):
        return subprocess.run(self.command(host, argv), env=self.env(env), timeout=timeout, text=True,
                              capture_output=True, check=check, **kwargs)

    def popen(self, host, argv, env=None, cwd=None, **kwargs):
        return subprocess.Popen(self.command(host, argv, cwd), env=self.env(env), text=True, **kwargs)

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

    def set_hosts_lines(self, host, lines):
        """Rewrites `host`'s /etc/hosts: `lines` first (a planted fault), then the usual ones.

        Written in place (same inode): the file is bind-mounted into the host's mount
        namespace, so a new file would not be seen there. `set_hosts_lines(host, [])`
        restores the usual content. Takes effect for every later lookup on that host.
        """
        lines = list(lines) + self._hosts_lines()
        with open(NETNS_ETC / host / "hosts", "r+") as handle:
            handle.write("\n".join(lines) + "\n")
            handle.truncate()

    @contextlib.contextmanager
    def shadow(self, host, path):
        """Hides `path` on `host` alone while the block runs (a package not installed there).

        An empty file (or folder) is bind-mounted over `path` inside the host's own mount
        namespace; the machine and the other hosts keep seeing the real one.
        """
        path = Path(path)
        empty = self.dir / f"shadow_{host}_{abs(hash(str(path)))}"
        if path.is_dir():
            empty.mkdir(exist_ok=True)
        else:
            empty.write_text("")
        enter = ["nsenter", "-t", str(self.host_pid(host)), "-m", "--"]
        _sh(*enter, "mount", "--bind", empty, path)
        try:
            yield
        finally:
            _sh(*enter, "umount", path, check=False)

    def link(self, host, up):
        """Takes `host`'s link to the switch down (`up=False`: the host drops off) or up again."""
        self.index(host)
        _sh("ip", "netns", "exec", self.switch, "ip", "link", "set", f"{host}v", "up" if up else "down")

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
        down(self.prefix)
        if self._lock is not None:
            self._lock.close()  # the prefix is free for another session
            self._lock = None


def _take_a_prefix():
    """(prefix, open lock file): the first of SESSION_PREFIXES no other process holds."""
    for prefix in SESSION_PREFIXES:
        handle = open(f"/tmp/keras_boost_cluster_{prefix}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return prefix, handle
    raise ClusterError(f"every cluster prefix {SESSION_PREFIXES} is in use by another process")


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


def down(prefix=PREFIX):
    """Removes the hosts and the switch of the cluster under `prefix`, and its files; safe to
    call when nothing is up."""
    directory = directory_for(prefix)
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
        if name == f"{prefix}sw" or (name.startswith(prefix) and name[len(prefix):].isdigit()):
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
    up_parser = sub.add_parser("up", help="make N hosts (removing earlier ones of the same prefix)")
    up_parser.add_argument("n", type=int)
    up_parser.add_argument("--rate", default=None, help="limit every link to RATE (tc units: 1gbit, 100mbit)")
    down_parser = sub.add_parser("down", help="remove the hosts")
    run_parser = sub.add_parser("run", help="run a command inside a host: run HOST -- CMD...")
    run_parser.add_argument("host")
    run_parser.add_argument("argv", nargs=argparse.REMAINDER)
    for each in (up_parser, down_parser, run_parser):
        each.add_argument("--prefix", default=PREFIX, choices=ALL_PREFIXES, help="host names <prefix>1.. "
                          f"(default {PREFIX})")
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = Cluster.up(args.n, args.prefix, rate=args.rate)
        for host in cluster.hosts:
            print(f"{host} {cluster.address(host)}")
        print(f"run a command on a host: ./scripts/cluster.sh run {cluster.hosts[0]} -- CMD")
        return 0
    if args.command == "down":
        down(args.prefix)
        return 0
    cluster = Cluster.load(args.prefix)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    proc = cluster.popen(args.host, argv or ["bash"], cwd=os.getcwd())  # relative paths as the caller wrote them
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
