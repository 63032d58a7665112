"""Command lines of the keras-boost command: options removed, horovodrun in front, hosts parsed."""

import os
import re
import shutil
import sys

HOSTS_FORM = "HOST:SLOTS[,HOST:SLOTS...] (e.g. node1:4,node2:4)"
HOSTFILE_FORM = "one host a line, `HOST slots=N` (horovodrun's and Open MPI's form) or `HOST:N`; # comments"
# Seconds horovodrun may spend checking ssh and finding the common network interface of
# the hosts before it gives up (its own default, 30 s, is short for hosts that import a
# Python environment from a network file system).
HOSTS_START_TIMEOUT = 120

_HOST = r"[A-Za-z0-9_.\-]+"  # a host name or an IPv4 address (horovodrun splits `-H` at ":")
_HOSTS_ENTRY = re.compile(rf"^({_HOST}):(\d+)$")
_HOSTFILE_SLOTS = re.compile(rf"^({_HOST})\s+slots\s*=\s*(\d+)(?:\s+max[_-]slots\s*=\s*\d+)?$")
_HOSTFILE_BARE = re.compile(rf"^({_HOST})$")


def without_options(argv, names):
    """`argv` without the options in `names` (`--name value...` or `--name=value`), values included."""
    cleaned, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token in names
            if skipping or token.split("=", 1)[0] in names:
                continue
        elif skipping:
            continue
        cleaned.append(token)
    return cleaned


def _entry(host, slots, where):
    count = int(slots)
    if count < 1:
        raise ValueError(f"{where}: {host} has {count} slots; a host needs at least 1")
    return host, count


def _no_repeats(hosts, where):
    seen = set()
    for host, _ in hosts:
        if host in seen:
            raise ValueError(f"{where}: {host} is listed twice; list each host once with all its slots")
        seen.add(host)
    return hosts


def parse_hosts(text):
    """`"h1:2,h2:2"` -> [("h1", 2), ("h2", 2)]; ValueError naming the value and the form expected."""
    entries = [part.strip() for part in str(text).split(",")]
    hosts = []
    for part in entries:
        match = _HOSTS_ENTRY.match(part)
        if not match:
            raise ValueError(f"expected {HOSTS_FORM}, got {text!r}"
                             + (f" ({part!r} has no :SLOTS)" if part and ":" not in part else ""))
        hosts.append(_entry(match.group(1), match.group(2), f"--hosts {text!r}"))
    return _no_repeats(hosts, f"--hosts {text!r}")


def parse_hostfile_text(text, name="hostfile"):
    """A hostfile's text -> [(host, slots)]: `host slots=N`, `host:N` or `host` (1 slot) a line."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name} line {number}"
        match = _HOSTFILE_SLOTS.match(line) or _HOSTS_ENTRY.match(line)
        if match:
            hosts.append(_entry(match.group(1), match.group(2), where))
        elif _HOSTFILE_BARE.match(line):
            hosts.append((line, 1))
        else:
            raise ValueError(f"{where}: expected {HOSTFILE_FORM}, got {raw.strip()!r}")
    if not hosts:
        raise ValueError(f"{name} names no host; expected {HOSTFILE_FORM}")
    return _no_repeats(hosts, name)


def parse_hostfile(path):
    """The hosts of the file at `path` (see `parse_hostfile_text`)."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"cannot read the hostfile {path!r}: {error.strerror or error}") from None
    return parse_hostfile_text(text, name=f"hostfile {path!r}")


def hosts_argument(hosts):
    """[("h1", 2), ("h2", 2)] -> "h1:2,h2:2" (horovodrun's and mpirun's `-H`)."""
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


def total_slots(hosts):
    return sum(slots for _, slots in hosts)


def resolve_np(np_workers, hosts):
    """The number of workers: `--np`, or the sum of the slots when hosts are given.

    Raises ValueError when `--np` asks for more workers than the hosts have slots.
    """
    if not hosts:
        return 1 if np_workers is None else np_workers
    slots = total_slots(hosts)
    if np_workers is None:
        return slots
    if np_workers > slots:
        raise ValueError(f"--np {np_workers} is more than the {slots} slot(s) of the hosts "
                         f"({hosts_argument(hosts)}); lower --np or give the hosts more slots")
    return np_workers


# A `keras-boost bench` launches one horovodrun per run from bench.py; the hosts it should
# use are set once for the process here (explicit arguments of `horovodrun_command` win).
_target = {"hosts": None, "network_interface": None, "start_timeout": None}


# the options of a launch, which the launched workers do not get
LAUNCH_OPTIONS = ("--np", "--hosts", "--hostfile", "--network-interface", "--start-timeout")


def launch_target():
    return dict(_target)


def set_launch_target(hosts=None, network_interface=None, start_timeout=None):
    """The hosts, interface and start timeout that `horovodrun_command` uses by default."""
    _target.update(hosts=list(hosts) if hosts else None, network_interface=network_interface,
                   start_timeout=start_timeout)


def horovodrun_path():
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        horovodrun = shutil.which("horovodrun")
    return horovodrun


def horovodrun_command(np_workers, controller, arguments, hosts=None, network_interface=None, start_timeout=None):
    """`horovodrun -np N -H <hosts> --<controller> python <arguments>`, or None without horovodrun.

    `hosts`: [(host, slots)] (default: this machine, `localhost:N`); `network_interface`:
    horovodrun's `--network-interface` (Gloo's interface, Open MPI's `btl_tcp_if_include`
    and NCCL's socket interface); `start_timeout`: horovodrun's `--start-timeout` (default
    HOSTS_START_TIMEOUT with hosts, unless HOROVOD_START_TIMEOUT is set; horovodrun's own
    default on this machine alone).
    """
    horovodrun = horovodrun_path()
    if horovodrun is None:
        return None
    hosts = hosts or _target["hosts"]
    network_interface = network_interface or _target["network_interface"]
    start_timeout = start_timeout or _target["start_timeout"]
    if hosts and start_timeout is None and "HOROVOD_START_TIMEOUT" not in os.environ:
        start_timeout = HOSTS_START_TIMEOUT
    command = [horovodrun, "-np", str(np_workers), "-H", hosts_argument(hosts) if hosts else f"localhost:{np_workers}"]
    if network_interface:
        command += ["--network-interface", network_interface]
    if start_timeout:
        command += ["--start-timeout", str(int(start_timeout))]
    return [*command, f"--{controller}", sys.executable, *arguments]


# After a worker has ended the job (the stall watchdog's exit), the launcher should end
# within seconds. Under Open MPI a host that lost its link keeps `mpirun`'s abort waiting on
# that host's daemon ("abort is already in progress"): in two tries on namespace hosts it
# was still waiting minutes later (Open MPI's own timeout for a lost daemon is TCP's
# retransmission, about 15 min; docs/reliability.md). So `keras-boost` watches
# its launcher's output and ends it `LAUNCHER_GRACE` seconds after such a line.
LAUNCHER_GRACE = 60.0
# Once a worker has named a rank that nothing was heard from (its host is gone), nothing more
# can come from waiting for that host's daemon.
NAMED_GRACE = 10.0
_ENDING = ("keras_boost: stall: rank ", "abort is already in progress")
_NAMED = ("keras_boost: stall: nothing heard from", )
_RANK_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:$")


def run_launcher(command, grace=None, echo=True, relaunch=None):
    """Runs `command` (horovodrun) and returns its exit status; its output passes through.

    Once a line of its output says that a worker is ending the job (keras_boost's stall
    watchdog, Open MPI's abort), the launcher gets `grace` seconds (`LAUNCHER_GRACE`) to
    end by itself, `NAMED_GRACE` once a worker has named a rank that went silent; after that its whole process group (mpirun, ssh, local workers) gets
    SIGTERM, then SIGKILL 5 s later, a line says why, and the status is the watchdog's 75.
    Ctrl-C and SIGTERM sent to this process are passed on to the group. A job that fails
    ends with a summary, after horovodrun's own traceback: the workers' lines that name a
    lost rank and its host, and `relaunch` (the command to run again) when given.
    """
    import signal
    import subprocess
    import threading
    import time

    from keras_boost.fit.watchdog import STALL_EXIT_CODE

    grace = LAUNCHER_GRACE if grace is None else float(grace)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    ending = {}

    from keras_boost.fit.watchdog import LOST_MARK

    named = []  # the workers' lines that name a lost rank, for the summary

    from keras_boost._startup import LineFilter, min_log_level

    def forward(source, target):
        quiet = LineFilter(min_log_level())  # horovodrun imports TensorFlow itself (its build check)
        for line in iter(source.readline, b""):
            if not quiet.keep(line):
                continue
            if "at" not in ending and any(mark.encode() in line for mark in _ENDING):
                ending["at"] = time.monotonic()
            text = line.decode(errors="replace").rstrip()
            for mark in (LOST_MARK, *_NAMED):
                # mpirun glues the next line's rank tag (`[1,0]<stderr>:`) to a line a worker ended with
                said = _RANK_TAG.sub("", text[text.index(mark):]) if mark in text else None
                if said and said not in named:
                    named.append(said)
            if any(mark in text for mark in _NAMED) or (LOST_MARK in text and "nothing heard from" in text):
                ending.setdefault("at", time.monotonic())
                ending["grace"] = min(grace, NAMED_GRACE)
            if echo and "killed" not in ending:  # not mpirun's own crash on the way out after SIGTERM
                target.write(line)
                target.flush()
        source.close()

    readers = [threading.Thread(target=forward, args=(process.stdout, _bytes_of(sys.stdout)), daemon=True),
               threading.Thread(target=forward, args=(process.stderr, _bytes_of(sys.stderr)), daemon=True)]
    for reader in readers:
        reader.start()

    def pass_on(signum, frame):
        _signal_group(process, signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, pass_on)
    try:
        while True:
            try:
                status = process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if "at" in ending and time.monotonic() - ending["at"] > ending.get("grace", grace):
                print(f"keras-boost: a worker ended the job {ending.get('grace', grace):.0f} s ago and the launcher "
                      "is still waiting (under MPI: for the daemon of a host that lost its link); ending it "
                      "(its output stops here).", file=sys.stderr, flush=True)
                ending["killed"] = True
                _signal_group(process, signal.SIGTERM)
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    _signal_group(process, signal.SIGKILL)
                    process.wait()
                status = STALL_EXIT_CODE
                break
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for reader in readers:
        reader.join(timeout=5)
    if status != 0:
        summary = [f"keras-boost: the job ended with status {status}."] + named
        if relaunch:
            summary.append(f"keras-boost: to go on, relaunch: {relaunch}")
        print("\n".join(summary), file=sys.stderr, flush=True)
    return status


def _bytes_of(stream):
    """A binary writer onto `stream` (its `buffer`; a text stream without one, e.g. a test's capture, gets text)."""
    if hasattr(stream, "buffer"):
        return stream.buffer

    class Text:
        @staticmethod
        def write(data):
            stream.write(data.decode(errors="replace"))

        @staticmethod
        def flush():
            stream.flush()

    return Text


def _signal_group(process, signum):
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------ Slurm
def _expand_nodelist(text):
    """Slurm's compressed host list ("node[01-03,7],gpu1") as names, without scontrol."""
    hosts, depth, part = [], 0, ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            if part:
                match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
                if not match:
                    hosts.append(part)
                else:
                    head, ranges, tail = match.groups()
                    for piece in ranges.split(","):
                        low, _, high = piece.partition("-")
                        for number in range(int(low), int(high or low) + 1):
                            hosts.append(f"{head}{number:0{len(low)}d}{tail}")
            part = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        part += ch
    return hosts


def _expand_counts(text, n):
    """SLURM_TASKS_PER_NODE ("2(x3),1") as a list of `n` counts."""
    counts = []
    for piece in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if not match:
            return [1] * n
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts if len(counts) == n else [1] * n


def slurm_hosts(environ=None):
    """[(host, slots)] of the Slurm allocation this command runs in, or None outside one.

    The hosts are SLURM_JOB_NODELIST's (`scontrol show hostnames`, or read here without it),
    the slots SLURM_TASKS_PER_NODE's (one worker per task: `--ntasks-per-node`), else 1 a host.
    """
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = None
    if shutil.which("scontrol"):
        import subprocess

        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=30)
        if done.returncode == 0 and done.stdout.split():
            hosts = done.stdout.split()
    hosts = hosts or _expand_nodelist(nodelist)
    counts = _expand_counts(env.get("SLURM_TASKS_PER_NODE", ""), len(hosts)) if env.get("SLURM_TASKS_PER_NODE") \
        else [1] * len(hosts)
    return list(zip(hosts, counts))
