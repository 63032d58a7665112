"""A check of this worker's host before Horovod starts: a hostname that resolves to loopback.

Debian and Ubuntu write `127.0.1.1 <hostname>` into /etc/hosts. Measured on namespace hosts
(tests/cluster.py; 3 hosts, the middle one's hostname mapped to 127.0.1.1 on itself,
Horovod 0.28.1):

- `horovodrun --gloo`: when the other hosts' addresses sort above 127.x (192.168.213.x
  here), `hvd.init()` ends the job within seconds with
  `gloo::IoException ... connect [127.0.1.1]:PORT: Connection refused` on the other hosts:
  the worker announced its loopback address to them. `HOROVOD_GLOO_IFACE=eth0` (which
  horovodrun sets; `--network-interface`) does not route around it. When every address
  sorts below 127.x (10.213.0.x), the same job trains: Gloo lets the side with the larger
  address open each connection, so the 127.0.1.1 worker always connects out and nobody
  connects to it — correct by the accident of address order only;
- `horovodrun --mpi` and plain `mpirun`: trains in both cases (Open MPI takes its
  addresses from the interfaces, not from the hostname).

`check_host_addresses()` reads the launcher's environment and says so before `hvd.init()`
where that failure will happen; `keras-boost info --hosts` reports the hostname on every
host before a launch.
"""

import ipaddress
import os
import socket


def _gloo_launch(env):
    """Whether this worker runs Horovod's Gloo controller (horovodrun --gloo sets these)."""
    if env.get("HOROVOD_CONTROLLER", "").lower() == "gloo":
        return True
    return "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env and "OMPI_COMM_WORLD_RANK" not in env


def _hosts_in_job(env):
    """How many hosts the job spans, from the launcher's environment (1 when unknown)."""
    if env.get("HOROVOD_CROSS_SIZE", "").isdigit():  # horovodrun: the number of hosts
        return int(env["HOROVOD_CROSS_SIZE"])
    size, local = env.get("OMPI_COMM_WORLD_SIZE", ""), env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if size.isdigit() and local.isdigit() and int(size) > int(local):
        return 2  # at least
    return 1


def _resolve(hostname):
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return None


def _interface_addresses():
    """{interface: [IPv4 address]} of this host (psutil, which comes with Horovod; {} without it)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - Horovod installs psutil
        return {}
    return {name: [a.address for a in addresses if a.family == socket.AF_INET]
            for name, addresses in psutil.net_if_addrs().items()}


def check_host_addresses(environ=None, hostname=None, resolve=_resolve, interface_addresses=_interface_addresses):
    """A message when this worker will announce a loopback address to workers on other hosts, else None.

    True under a Gloo launch (horovodrun --gloo: `HOROVOD_CONTROLLER=gloo`,
    `HOROVOD_GLOO_RENDEZVOUS_ADDR`) that spans more than one host (`HOROVOD_CROSS_SIZE`),
    when this host's hostname resolves to a loopback address here and the host has an
    address that sorts above it on the interface the hosts share (`HOROVOD_GLOO_IFACE`,
    else any): the others then connect to the loopback address and fail (see the module
    docstring). None under MPI, on one host, and without a launcher.
    `environ`, `hostname`, `resolve` and `interface_addresses` are for tests.
    """
    env = os.environ if environ is None else environ
    if not _gloo_launch(env) or _hosts_in_job(env) < 2:
        return None
    hostname = hostname or socket.gethostname()
    address = resolve(hostname)
    try:
        loopback = ipaddress.ip_address(address) if address else None
    except ValueError:
        return None
    if loopback is None or not loopback.is_loopback:
        return None
    by_interface = interface_addresses()
    iface = env.get("HOROVOD_GLOO_IFACE")
    texts = by_interface.get(iface) if iface in by_interface else [a for v in by_interface.values() for a in v]
    real = []
    for text in texts:
        try:
            candidate = ipaddress.ip_address(text)
        except ValueError:
            continue
        if candidate.version == loopback.version and not candidate.is_loopback:
            real.append(candidate)
    above = sorted(a for a in real if a > loopback)
    if not above:
        return None  # every address sorts below: this worker opens all its Gloo connections
    iface = iface or "eth0"
    return (f"this host's hostname {hostname} resolves to {address} here (a loopback address, e.g. Debian's "
            f"`127.0.1.1 {hostname}` line in /etc/hosts), and the job spans {_hosts_in_job(env)} hosts under "
            "Horovod's Gloo controller: Gloo announces that address to the other hosts, which cannot connect to "
            f"it (`connect [{address}]:PORT: Connection refused`), even with HOROVOD_GLOO_IFACE={iface}. Map "
            f"{hostname} to this host's address on the network the hosts share (e.g. {above[0]}) in /etc/hosts, "
            "or launch with --controller mpi (horovodrun --mpi); `keras-boost info --hosts ...` checks every host")


# What `keras-boost info --hosts` (keras_boost/app/preflight.py) runs with each host's Python:
# the versions of TensorFlow, Keras, Horovod (and its controllers) and keras_boost there, and
# the host's IPv4 interfaces, as one "@@json" line. Plain Python text: that host may lack any
# of these packages, which is what it reports.
PROBE_PYTHON = r'''
import json, platform, sys
facts = {"found": True, "executable": sys.executable, "python": platform.python_version(), "versions": {},
         "errors": {}}

def attempt(name, load):
    try:
        facts["versions"][name] = load()
    except BaseException as error:  # noqa: BLE001 - any failure to import is the finding
        text = (str(error).strip().splitlines() or [""])[0]
        facts["errors"][name] = (type(error).__name__ + (": " + text if text else ""))[:300]

def horovod_version():
    import horovod
    import horovod.tensorflow as hvd
    facts["mpi_built"] = bool(hvd.mpi_built())
    facts["gloo_built"] = bool(hvd.gloo_built())
    return horovod.__version__

attempt("tensorflow", lambda: __import__("tensorflow").__version__)
attempt("keras", lambda: __import__("keras").__version__)
attempt("horovod", horovod_version)
attempt("keras_boost", lambda: __import__("keras_boost").__version__)
try:
    import psutil
    facts["interfaces"] = [[name, a.address, a.netmask] for name, addresses in psutil.net_if_addrs().items()
                           for a in addresses if a.family == 2]
except BaseException:  # noqa: BLE001
    pass
print("@@json " + json.dumps(facts), flush=True)
'''
