"""Horovod built for the TensorFlow of this environment (`keras-boost build-horovod`, scripts/setup.sh).

Horovod's last release does not build against TensorFlow 2.19 or later as released. This
module downloads its source distribution once, applies keras_boost's patch set
(`keras_boost/horovod_patches/*.patch`, in name order, each saying which upstream change it
stands for), and builds a wheel with TensorFlow, MPI and Gloo against the TensorFlow that the
running Python imports. Wheels are cached per Horovod version, TensorFlow version, Python,
machine and patch set, so a second environment with the same versions installs in seconds.

    keras-boost build-horovod               build (or take from the cache), install, verify, report
    keras-boost build-horovod --print-plan  what it would build and where, changing nothing
"""

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from keras_boost import _versions

PATCHES = Path(__file__).resolve().parent.parent / "horovod_patches"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "keras_boost")
# Horovod's own run-time requirements (its wheel is installed with --no-deps).
RUNTIME_REQUIREMENTS = ("cloudpickle", "psutil", "pyyaml", "packaging", "cffi")
# TensorFlow 2.19's wheel includes LLVM headers it does not ship (TensorFlow issue #90026);
# Debian's llvm-14-dev has them.
LLVM_INCLUDE = ("/usr/include/llvm-14", "/usr/include/llvm-c-14")
HEADER_ROOTS = ("/usr/include", "/usr/local/include")
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]\s+(.*)$")


class BuildError(RuntimeError):
    """A step of the build failed; the message says which and what to do."""


def say(message):
    print(f"[build-horovod] {message}", flush=True)


def patch_files():
    return sorted(PATCHES.glob("*.patch"))


def patch_set_id():
    """8 hex digits naming the patch set (scripts/setup.sh computes the same: cat | sha256sum)."""
    digest = hashlib.sha256()
    for path in patch_files():
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def patch_summary(path):
    """The first line of a patch file's header: what it does."""
    for line in path.read_text().splitlines():
        if line.strip():
            return line.strip()
    return path.name


def tensorflow_info(python):
    """(version, built_with_cuda, include_dir) of the TensorFlow that `python` imports."""
    code = ("import json, tensorflow as tf; print(json.dumps([tf.__version__, tf.test.is_built_with_cuda(), "
            "tf.sysconfig.get_include()]))")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:
        raise BuildError(f"{python} cannot import TensorFlow:\n{result.stderr.strip()[-2000:]}\nInstall it first, "
                         f"e.g. {python} -m pip install 'tensorflow-cpu=={_versions.DEFAULT_TENSORFLOW}'")
    import json

    version, cuda, include = json.loads(result.stdout.strip().splitlines()[-1])
    return version, bool(cuda), include


def python_tag(python):
    result = subprocess.run([python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
                            capture_output=True, text=True, check=True)
    return result.stdout.strip()


def wheel_dir(cache, tf_version, pytag, suffix=""):
    """The cache folder of one build (scripts/setup.sh names its folders the same way)."""
    return os.path.join(cache, f"horovod-{_versions.HOROVOD}-tf{tf_version}-{pytag}-{platform.machine()}"
                               f"-p{patch_set_id()}{suffix}")


def plan(python=None, cache=None):
    """What a build for `python`'s environment would be: versions, wheel folder, extra flags, missing tools."""
    python = python or sys.executable
    cache = cache or os.environ.get("KERAS_BOOST_CACHE") or DEFAULT_CACHE
    tf_version, cuda, include = tensorflow_info(python)
    problem = _versions.tensorflow_problem(tf_version)
    if problem:
        raise BuildError(problem)
    extra_env = {}
    missing = []
    for tool, package in (("cmake", "cmake"), ("g++", "g++"), ("mpicxx", "libopenmpi-dev openmpi-bin"),
                          ("mpirun", "openmpi-bin"), ("patch", "patch")):
        if shutil.which(tool) is None:
            missing.append((tool, package))
    # TensorFlow's XLA headers include these; its wheel does not ship them.
    for header, package in (("highwayhash/highwayhash.h", "libhighwayhash-dev"), ("farmhash.h", "libfarmhash-dev")):
        if not any(os.path.exists(os.path.join(root, header)) for root in (include, *HEADER_ROOTS)):
            missing.append((header, package))
    if _versions.version_tuple(tf_version) == (2, 19):
        if not os.path.isdir(os.path.join(include, "llvm")):
            if not all(os.path.isdir(path) for path in LLVM_INCLUDE):
                missing.append((LLVM_INCLUDE[0], "llvm-14-dev"))
            flags = " ".join(f"-idirafter {path}" for path in LLVM_INCLUDE)
            extra_env["CXXFLAGS"] = (os.environ.get("CXXFLAGS", "") + " " + flags).strip()
    return {
        "python": python,
        "tensorflow": tf_version,
        "tensorflow_cuda": cuda,
        "horovod": _versions.HOROVOD,
        "patches": [(path.name, patch_summary(path)) for path in patch_files()],
        "wheel_dir": wheel_dir(cache, tf_version, python_tag(python)),
        "cache": cache,
        "extra_env": extra_env,
        "missing": missing,
    }


def format_plan(p):
    lines = [f"Horovod {p['horovod']} for TensorFlow {p['tensorflow']} in {p['python']}",
             "  with TensorFlow, MPI and Gloo (CPU operations"
             + ("; GPU tensors staged through host memory)" if p["tensorflow_cuda"] else ")")]
    for name, summary in p["patches"]:
        lines.append(f"  patch {name}: {summary}")
    for key, value in p["extra_env"].items():
        lines.append(f"  {key}={value}")
    lines.append(f"  wheel cache: {p['wheel_dir']}")
    if p["missing"]:
        packages = sorted({package for _, package in p["missing"]})
        lines.append(f"  missing: {', '.join(tool for tool, _ in p['missing'])}; install them first: "
                     f"apt-get install {' '.join(packages)}")
    return "\n".join(lines)


def _sdist(cache, python):
    folder = Path(cache) / "sdist"
    path = folder / f"horovod-{_versions.HOROVOD}.tar.gz"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    say(f"downloading the source of horovod=={_versions.HOROVOD} from PyPI")
    result = subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                             "--no-build-isolation", "-d", str(folder), f"horovod=={_versions.HOROVOD}"],
                            capture_output=True, text=True)
    if result.returncode != 0 or not path.exists():
        raise BuildError(f"pip could not download horovod=={_versions.HOROVOD}'s source:\n{result.stderr[-2000:]}")
    return path


def unpack_and_patch(sdist, into):
    """Unpacks the sdist into `into` and applies every patch; returns the source folder."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(into, filter="data")
        else:  # Python before 3.11.4
            archive.extractall(into)
    source = Path(into) / f"horovod-{_versions.HOROVOD}"
    for path in patch_files():
        result = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(path)], cwd=source,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"patch {path.name} does not apply to horovod {_versions.HOROVOD}:\n"
                             f"{result.stdout}{result.stderr}")
        say(f"applied {path.name}: {patch_summary(path)}")
    return source


def _compile(python, source, out_dir, extra_env, log_path):
    env = dict(os.environ)
    env.update(HOROVOD_WITH_TENSORFLOW="1", HOROVOD_WITH_MPI="1", HOROVOD_WITH_GLOO="1",
               HOROVOD_WITHOUT_PYTORCH="1", HOROVOD_WITHOUT_MXNET="1")
    env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 1}")
    env.update(extra_env)
    command = [python, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-cache-dir", "--no-deps",
               "-w", str(out_dir), str(source)]
    start = time.monotonic()
    shown = -10
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   errors="replace")
        for line in process.stdout:
            log.write(line)
            match = _PROGRESS.match(line.strip())
            if match and int(match.group(1)) >= shown + 10:
                shown = int(match.group(1))
                what = match.group(2).rsplit("/", 1)[-1].removesuffix(".o")
                say(f"  {shown:3d}% after {time.monotonic() - start:4.0f} s ({what})")
        code = process.wait()
    if code != 0:
        with open(log_path) as log:
            tail = log.readlines()[-40:]
        raise BuildError("the compiler stopped; the last lines of its output:\n" + "".join(tail)
                         + f"(the whole output: {log_path})")
    return time.monotonic() - start


def build(p, force=False):
    """Builds the wheel of plan `p` into its cache folder unless one is there; returns the folder."""
    if p["missing"]:
        raise BuildError(format_plan(p).splitlines()[-1].strip())
    target = Path(p["wheel_dir"])
    if not force and list(target.glob("horovod-*.whl")):
        say(f"using the cached wheel in {target}")
        return target
    target.mkdir(parents=True, exist_ok=True)
    sdist = _sdist(p["cache"], p["python"])
    with tempfile.TemporaryDirectory(prefix="horovod-build-", dir=p["cache"]) as work:
        source = unpack_and_patch(sdist, work)
        say("compiling (about 4 minutes on 2 cores)")
        log_path = os.path.join(p["cache"], f"build-horovod-tf{p['tensorflow']}.log")
        seconds = _compile(p["python"], source, Path(work) / "wheel", p["extra_env"], log_path)
        for wheel in (Path(work) / "wheel").glob("horovod-*.whl"):
            for old in target.glob("horovod-*.whl"):
                old.unlink()
            shutil.move(str(wheel), target / wheel.name)
    say(f"built in {seconds:.0f} s: {next(target.glob('horovod-*.whl')).name}")
    return target


def install(p, folder):
    wheel = next(Path(folder).glob("horovod-*.whl"))
    say(f"installing {wheel.name} into {p['python']}")
    for command in ([p["python"], "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
                    [p["python"], "-m", "pip", "install", "-q", *RUNTIME_REQUIREMENTS]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")


def verify(python, need_nccl=False):
    """Raises BuildError unless `python` imports Horovod of our version with MPI and Gloo (and NCCL)."""
    code = ("import sys, horovod, horovod.tensorflow as hvd; "
            "print(horovod.__version__, hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built())")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if result.returncode != 0:
        raise BuildError(f"horovod does not import:\n{result.stderr[-2000:]}")
    version, mpi, gloo, nccl = result.stdout.split()[-4:]
    if version != _versions.HOROVOD or mpi != "True" or gloo != "True" or (need_nccl and not int(nccl)):
        raise BuildError(f"horovod {version} imports with mpi={mpi}, gloo={gloo}, nccl={nccl}; "
                         f"expected {_versions.HOROVOD} with MPI and Gloo" + (" and NCCL" if need_nccl else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="keras-boost build-horovod", description=__doc__.split("\n\n")[0])
    parser.add_argument("--print-plan", action="store_true", help="say what would be built and where; change nothing")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache has the wheel")
    parser.add_argument("--wheel-dir", default=None, help="build into this folder and install nothing "
                        "(scripts/setup.sh, which installs the wheel itself)")
    parser.add_argument("--cache", default=None, help="the wheel cache (default $KERAS_BOOST_CACHE or "
                        "~/.cache/keras_boost)")
    parser.add_argument("--python", default=None, help="the Python whose environment to build for (default: this one)")
    args = parser.parse_args(argv)
    try:
        p = plan(args.python, args.cache)
        if args.wheel_dir:
            p["wheel_dir"] = args.wheel_dir
        say(format_plan(p).replace("\n", "\n[build-horovod] "))
        if args.print_plan:
            return 0
        folder = build(p, force=args.force)
        if args.wheel_dir:
            return 0
        install(p, folder)
        verify(p["python"])
    except BuildError as error:
        say(f"ERROR: {error}")
        return 1
    say("done; keras-boost info reports:")
    result = subprocess.run([p["python"], "-m", "keras_boost.app.cli", "info"], text=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
