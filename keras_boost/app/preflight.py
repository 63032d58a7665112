"""`keras-boost info --hosts ...`: checks the hosts of a multi-host launch before it starts.

Run from the launching host, it gathers on every host, over the `ssh` that horovodrun uses
(BatchMode, a connect timeout and an overall timeout per host, so a dead host cannot hang
it; hosts that are this machine are probed without ssh, as horovodrun runs them):

- that ssh works;
- the host's own hostname and the addresses it resolves to *on that host*
  (`getent ahosts $(hostname)`);
- its IPv4 interfaces (`ip -o -4 addr`, else psutil);
- with the launcher's Python path (`sys.executable`), run from the launcher's working
  directory as horovodrun runs the workers: that this Python exists and imports
  tensorflow, keras, horovod (and how it was built: MPI, Gloo) and keras_boost, and their
  versions.

The pure functions below turn those facts into a table and a list of problems, each in
plain words with what to change: ssh failing, a hostname that resolves to a loopback
address while other hosts take part, two hosts with one hostname, no network interface
shared by all hosts on one subnet, a Python or package missing, versions that differ from
the launcher's. They are unit-tested without ssh (tests/test_cli_hosts.py), and on a
cluster of namespace hosts (tests/cluster.py).
"""

import ipaddress
import json
import os
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from keras_boost.distributed.hosts import PROBE_PYTHON

PACKAGES = ("tensorflow", "keras", "horovod", "keras_boost")
CONNECT_TIMEOUT = 10  # seconds for ssh to connect
DEFAULT_TIMEOUT = 90.0  # seconds for one host's whole probe (ssh, then importing TensorFlow there)
# horovodrun's own ssh options (horovod.runner.util.remote), plus BatchMode: never a prompt
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no",
               "-o", f"ConnectTimeout={CONNECT_TIMEOUT}")



# The launcher's variables that decide what a worker imports; horovodrun forwards them to
# the workers (Gloo: on the ssh command line; MPI: `mpirun -x`), so the probe does too.
FORWARDED = ("PYTHONPATH", "LD_LIBRARY_PATH")


def probe_script(python, cwd, environ=None):
    """The shell script run on every host (`sh -s`): hostname, resolution, interfaces, Python.

    It runs from `cwd` (horovodrun starts the workers in the launcher's directory) with the
    launcher's FORWARDED variables from `environ` (default: this process's).
    """
    environ = os.environ if environ is None else environ
    exports = "".join(f"export {name}={shlex.quote(environ[name])}\n" for name in FORWARDED if environ.get(name))
    python = shlex.quote(python)
    return (f"cd {shlex.quote(cwd)} >/dev/null 2>&1\n"
            f"{exports}"
            "export TF_CPP_MIN_LOG_LEVEL=2\n"
            'echo "@@hostname $(hostname)"\n'
            "echo @@resolve\n"
            'getent ahosts "$(hostname)" 2>/dev/null\n'
            "echo @@ip\n"
            "ip -o -4 addr show 2>/dev/null\n"
            "echo @@python\n"
            f"if [ -x {python} ]; then\n"
            f"{python} - <<'KB_PREFLIGHT_EOF'\n{PROBE_PYTHON}\nKB_PREFLIGHT_EOF\n"
            'else echo \'@@json {"found": false}\'; fi\n'
            "echo @@end\n")


# ------------------------------------------------------------------ pure: parsing
def _unique(items):
    seen, ordered = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            ordered.append(item)
    return ordered


def _prefix(netmask):
    try:
        return ipaddress.IPv4Network(f"0.0.0.0/{netmask}").prefixlen
    except ValueError:
        return 32


def parse_probe(output):
    """The facts in a probe's stdout: hostname, addresses, interfaces, python (None when absent)."""
    facts = {"hostname": None, "addresses": [], "interfaces": [], "python": None}
    section, ip_lines, resolve_lines = None, [], []
    for line in output.splitlines():
        if line.startswith("@@hostname"):
            facts["hostname"] = line[len("@@hostname"):].strip() or None
        elif line.startswith("@@json "):
            try:
                facts["python"] = json.loads(line[len("@@json "):])
            except ValueError:
                facts["python"] = None
        elif line.startswith("@@"):
            section = line[2:].strip()
        elif section == "resolve" and line.strip():
            resolve_lines.append(line.split()[0])
        elif section == "ip" and line.strip():
            ip_lines.append(line)
    facts["addresses"] = _unique(resolve_lines)
    for line in ip_lines:  # "2: eth0    inet 10.213.0.2/24 brd ... scope global eth0"
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "inet":
            address, _, prefix = fields[3].partition("/")
            facts["interfaces"].append({"name": fields[1].split("@")[0], "address": address,
                                        "prefix": int(prefix or 32)})
    if not facts["interfaces"] and facts["python"] and facts["python"].get("interfaces"):
        facts["interfaces"] = [{"name": name, "address": address, "prefix": _prefix(mask)}
                               for name, address, mask in facts["python"]["interfaces"]]
    if facts["python"] is not None:
        facts["python"].pop("interfaces", None)
    return facts


def is_loopback(address):
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _routable(interfaces):
    """{name: [IPv4Interface]} without loopback addresses."""
    found = {}
    for entry in interfaces:
        if is_loopback(entry["address"]):
            continue
        try:
            found.setdefault(entry["name"], []).append(
                ipaddress.IPv4Interface(f"{entry['address']}/{entry['prefix']}"))
        except ValueError:
            continue
    return found


def shared_interfaces(hosts):
    """Interfaces that every answering host has, on one subnet, with distinct addresses.

    `hosts`: facts dicts (`host`, `interfaces`); returns [{"name", "network", "addresses":
    {host: address}}], best first (the order of the first host's interfaces). An interface
    on the same subnet with the same address on every host (docker0's 172.17.0.1) is no
    network between them and is left out.
    """
    answering = [h for h in hosts if h.get("interfaces")]
    if not answering:
        return []
    tables = [_routable(h["interfaces"]) for h in answering]
    names = [name for name in tables[0] if all(name in t for t in tables[1:])]
    shared = []
    for name in names:
        for candidate in tables[0][name]:
            network = candidate.network
            chosen = {}
            for host, table in zip(answering, tables):
                match = next((i for i in table[name] if i.network == network), None)
                if match is None:
                    break
                chosen[host["host"]] = str(match.ip)
            else:
                if len(set(chosen.values())) == len(chosen):
                    shared.append({"name": name, "network": str(network), "addresses": chosen})
                    break
    return shared


# ------------------------------------------------------------------ pure: problems
def _problem(host, kind, message):
    return {"host": host, "kind": kind, "message": message}


def _python_problems(host, python, launcher, path):
    label = "this host (the launcher)" if host is None else host
    if python is None:
        return [_problem(host, "python", f"{label}: the check of {path} gave no answer (it crashed?); run "
                         f"`{path} -c 'import keras_boost'` there to see why")]
    if not python.get("found"):
        return [_problem(host, "python", f"{label}: {path} does not exist there. horovodrun starts every worker "
                         "with the launcher's Python path: install the same environment at the same path on "
                         "every host (or share it, e.g. over NFS)")]
    problems = []
    for package, error in sorted(python.get("errors", {}).items(), key=lambda kv: PACKAGES.index(kv[0])):
        problems.append(_problem(host, "import", f"{label}: {package} does not import with {path} ({error}): "
                                 f"install it there in the same version as on the launcher "
                                 f"({(launcher or {}).get('versions', {}).get(package) or 'see its table line'})"))
    if launcher is None or host is None or not launcher.get("found"):
        return problems
    differ = []
    if python.get("python") != launcher.get("python"):
        differ.append(f"Python {python.get('python')} there, {launcher.get('python')} here")
    for package in PACKAGES:
        theirs, mine = python.get("versions", {}).get(package), launcher.get("versions", {}).get(package)
        if theirs and mine and theirs != mine:
            differ.append(f"{package} {theirs} there, {mine} here")
    if differ:
        problems.append(_problem(host, "versions", f"{host}: versions differ from the launcher's ("
                                 + "; ".join(differ) + "): install the same versions on every host (workers "
                                 "with different versions are refused at fit start)"))
    for controller in ("mpi", "gloo"):
        key = f"{controller}_built"
        if key in python and key in launcher and python[key] != launcher[key]:
            problems.append(_problem(host, "controller", f"{host}: Horovod there is built "
                                     f"{'with' if python[key] else 'without'} {controller.upper()}, here "
                                     f"{'with' if launcher[key] else 'without'}: --controller {controller} "
                                     "needs it on every host; build Horovod the same way everywhere"))
    return problems


def find_problems(hosts, launcher=None, network_interface=None, python_path=None):
    """Every problem of the hosts, as [{"host", "kind", "message"}] (empty: ready to launch).

    `hosts`: facts dicts in the order given (`host`, `ssh_error`, `hostname`, `addresses`,
    `interfaces`, `python`); `launcher`: the launcher's own `python` facts;
    `network_interface`: the interface the user means to pass, if any.
    """
    python_path = python_path or sys.executable
    problems = []
    answering = []
    for host in hosts:
        if host.get("ssh_error"):
            problems.append(_problem(host["host"], "ssh", f"{host['host']}: {host['ssh_error']}"))
            continue
        answering.append(host)
        problems += _python_problems(host["host"], host.get("python"), launcher, python_path)
    if launcher is not None and launcher.get("errors") and not any(h.get("local") for h in hosts):
        problems += [p for p in _python_problems(None, launcher, None, python_path) if p["kind"] == "import"]
    several = len({h["host"] for h in hosts}) > 1
    shared = shared_interfaces(answering)
    named = [s for s in shared if s["name"] == network_interface] if network_interface else shared
    if several:
        for host in answering:
            loopback = [a for a in host.get("addresses", []) if is_loopback(a)]
            if loopback and host.get("hostname"):
                real = None
                for entry in named or shared:
                    real = (entry["name"], entry["addresses"].get(host["host"]))
                    break
                where = f"its address on {real[0]} ({real[1]})" if real and real[1] else \
                    "its address on the network the hosts share"
                problems.append(_problem(host["host"], "loopback", (
                    f"{host['host']}: its hostname {host['hostname']} resolves to {loopback[0]} on {host['host']} "
                    "(a loopback address): other hosts cannot reach a worker that announces it. Fix /etc/hosts on "
                    f"{host['host']} to map {host['hostname']} to {where}, or use --controller mpi (Horovod's Gloo "
                    "announces the hostname's address even with --network-interface; Open MPI takes the "
                    "interface's)")))
        by_name = {}
        for host in answering:
            if host.get("hostname"):
                by_name.setdefault(host["hostname"], []).append(host["host"])
        for hostname, names in by_name.items():
            if len(names) > 1:
                problems.append(_problem(names[1], "hostname", (
                    f"{' and '.join(names)} report the same hostname {hostname}: if they are one machine, list it "
                    "once with all its slots (two entries give two workers local rank 0, on the same GPU); if not, "
                    "give each host its own hostname (hostnamectl set-hostname)")))
        if len(answering) > 1:
            listing = "; ".join(f"{h['host']}: " + (", ".join(f"{i['name']} {i['address']}/{i['prefix']}"
                                                             for i in h["interfaces"] if not is_loopback(i["address"]))
                                                   or "none") for h in answering)
            if network_interface and not named:
                problems.append(_problem(None, "interface", (
                    f"--network-interface {network_interface} is not on every host on one subnet ({listing}): "
                    + (f"use {shared[0]['name']}" if shared else "give the hosts an interface of the same name on one "
                       "subnet"))))
            elif not shared:
                problems.append(_problem(None, "interface", (
                    f"no network interface is shared by all hosts on one subnet ({listing}): horovodrun needs an "
                    "interface of the same name with an address on one network on every host (rename the "
                    "interfaces, or run on hosts that share one)")))
    return problems


# ------------------------------------------------------------------ pure: report
def _versions_cell(python, package):
    if python is None or not python.get("found"):
        return "-"
    if package in python.get("errors", {}):
        return "MISSING" if "No module named" in python["errors"][package] else "ERROR"
    version = python.get("versions", {}).get(package, "-")
    if package == "horovod" and version != "-":
        built = [c for c in ("mpi", "gloo") if python.get(f"{c}_built")]
        version += f" ({','.join(built) or 'no controllers'})"
    return version


def table_rows(hosts):
    header = ["host", "slots", "ssh", "hostname", "resolves to", "IPv4 interfaces", "python", *PACKAGES]
    rows = [header]
    for host in hosts:
        python = host.get("python")
        if host.get("ssh_error"):
            rows.append([host["host"], str(host.get("slots", "")), "FAILED"] + ["-"] * (len(header) - 3))
            continue
        addresses = ", ".join(a + (" (loopback)" if is_loopback(a) else "") for a in host.get("addresses", [])) or "-"
        interfaces = ", ".join(f"{i['name']} {i['address']}/{i['prefix']}" for i in host.get("interfaces", [])
                               if not is_loopback(i["address"])) or "-"
        if python is None:
            py = "no answer"
        elif not python.get("found"):
            py = "MISSING"
        else:
            py = python.get("python", "?")
        rows.append([host["host"], str(host.get("slots", "")), "local" if host.get("local") else "ok",
                     host.get("hostname") or "-", addresses, interfaces, py,
                     *[_versions_cell(python, p) for p in PACKAGES]])
    return rows


def format_report(report):
    """The text of `keras-boost info --hosts`: a table, the shared interface, the problems."""
    rows = table_rows(report["hosts"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    launcher = report.get("launcher") or {}
    if launcher.get("found"):
        lines.append("")
        lines.append(f"launcher: {report['python_path']} (Python {launcher.get('python')}), run from "
                     f"{report['cwd']}: " + ", ".join(f"{p} {_versions_cell(launcher, p)}" for p in PACKAGES))
    shared = report.get("shared_interfaces") or []
    if len(report["hosts"]) > 1 and shared:
        first = shared[0]
        others = f" (also shared: {', '.join(s['name'] for s in shared[1:])})" if len(shared) > 1 else ""
        answered = sum(1 for host in report["hosts"] if not host.get("ssh_error"))
        where = ("every host" if answered == len(report["hosts"]) else
                 f"every host that answered ({answered} of {len(report['hosts'])})")
        lines.append(f"network: {first['name']} ({first['network']}) is on {where}{others}; horovodrun picks "
                     f"a common interface itself, or pass --network-interface {first['name']}")
    problems = report["problems"]
    if problems:
        lines.append("")
        lines.append(f"{len(problems)} problem(s):")
        lines += [f"- {p['message']}" for p in problems]
    else:
        lines.append("")
        lines.append(f"no problems found: ready for `keras-boost train --hosts {report['hosts_argument']}`")
    return "\n".join(lines)


# ------------------------------------------------------------------ gathering (ssh)
def local_addresses():
    """This machine's addresses (horovodrun's test of which hosts are local)."""
    found = {"127.0.0.1", "::1"}
    try:
        import psutil

        for addresses in psutil.net_if_addrs().values():
            found.update(a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6))
    except ImportError:  # pragma: no cover - psutil comes with Horovod
        try:
            found.add(socket.gethostbyname(socket.gethostname()))
        except OSError:
            pass
    return found


def is_local(host, addresses=None):
    """Whether `host` is this machine: its address here is one of this machine's (as horovodrun decides)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address in (addresses if addresses is not None else local_addresses())


def _run_probe(command, script, timeout):
    """(stdout, stderr, returncode or None on timeout) of one probe."""
    try:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)
    except OSError as error:
        return "", str(error), 127
    try:
        out, err = process.communicate(script, timeout=timeout)
        return out, err, process.returncode
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        return out or "", err or "", None


def _last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def probe_host(host, slots, script, timeout, local):
    """The facts of one host (see `find_problems`), through ssh unless it is `local`."""
    command = ["sh", "-s"] if local else ["ssh", *SSH_OPTIONS, host, "sh -s"]
    out, err, code = _run_probe(command, script, timeout)
    facts = {"host": host, "slots": slots, "local": local, "ssh_error": None}
    if code is None and "@@hostname" not in out:
        facts["ssh_error"] = (f"no answer within {timeout:g} s (is the host up? `ssh {host} true` should return "
                              "at once without a password)")
        return facts
    if code == 255 and not local and "@@hostname" not in out:
        facts["ssh_error"] = (f"`ssh {host}` failed: {_last_line(err) or 'exit status 255'}. horovodrun starts "
                              f"the workers over ssh without a password: make `ssh {host} true` work from this host "
                              f"(key-based login, e.g. ssh-copy-id {host}; the host up; its name resolving here)")
        return facts
    facts.update(parse_probe(out))
    if code is None and facts["python"] is None:
        facts["python"] = {"found": True, "versions": {}, "errors": {
            "tensorflow": f"TimeoutError: importing the packages took more than {timeout:g} s"}}
    return facts


def run_preflight(hosts, network_interface=None, timeout=DEFAULT_TIMEOUT, python=None, cwd=None):
    """Probes every host (in parallel) and returns the report dict (`ok`, `hosts`, `problems`, ...)."""
    from keras_boost.app.launch import hosts_argument

    python = python or sys.executable
    cwd = cwd or os.getcwd()
    script = probe_script(python, cwd)
    mine = local_addresses()
    local = {host: is_local(host, mine) for host, _ in hosts}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts) + 1)) as pool:
        launcher_job = None if any(local.values()) else pool.submit(probe_host, "localhost", 0, script, timeout, True)
        jobs = [pool.submit(probe_host, host, slots, script, timeout, local[host]) for host, slots in hosts]
        facts = [job.result() for job in jobs]
        launcher_facts = launcher_job.result() if launcher_job else next(f for f in facts if f["local"])
    launcher = launcher_facts.get("python")
    problems = find_problems(facts, launcher, network_interface, python)
    return {"ok": not problems, "hosts": facts, "launcher": launcher, "python_path": python, "cwd": cwd,
            "hosts_argument": hosts_argument(hosts), "shared_interfaces": shared_interfaces(
                [f for f in facts if not f.get("ssh_error")]), "problems": problems}
