"""scripts/setup.sh --print-plan: the install variant chosen from nvidia-smi and the TensorFlow
asked for by TF_VERSION, without installing anything.

A fake `nvidia-smi` on PATH stands in for a GPU machine's driver tool.
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from keras_boost import _versions
from keras_boost.app import horovod_build

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"
PYTAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
# The suite runs under `TF_VERSION=X ./scripts/test.sh` too: the plan follows the variable.
TF = os.environ.get("TF_VERSION") or _versions.DEFAULT_TENSORFLOW


def fake_nvidia_smi(folder, listing, exit_code=0):
    """A `nvidia-smi` script in `folder` that prints `listing` for `-L` and exits with `exit_code`."""
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'END'\n{listing}\nEND\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def print_plan(tmp_path, fake_bin=None, device=None, tf_version=None):
    path = os.environ["PATH"] if fake_bin is None else f"{fake_bin}:{os.environ['PATH']}"
    if fake_bin is None:  # a PATH without any nvidia-smi
        path = ":".join(p for p in path.split(":") if not (Path(p) / "nvidia-smi").exists())
    env = dict(os.environ, PATH=path, KERAS_BOOST_CACHE=str(tmp_path / "cache"))
    env.pop("KERAS_BOOST_DEVICE", None)
    if device is not None:
        env["KERAS_BOOST_DEVICE"] = device
    if tf_version is not None:
        env["TF_VERSION"] = tf_version
    result = subprocess.run(["bash", str(SETUP), "--print-plan"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.strip().splitlines())


def wheel_dir(tmp_path, suffix="", tf_version=TF):
    return horovod_build.wheel_dir(str(tmp_path / "cache"), tf_version, PYTAG, suffix)


def test_cpu_machine_plans_tensorflow_cpu_and_the_patched_horovod_wheel(tmp_path):
    plan = print_plan(tmp_path)
    assert plan["variant"].startswith("cpu (no NVIDIA GPU")
    assert plan["tensorflow"] == f"tensorflow-cpu=={TF}"
    assert plan["horovod"] == "CPU operations (TensorFlow + MPI + Gloo)"
    # the folder keras-boost build-horovod uses too: one cache, named by the patch set as well
    assert plan["wheel cache"] == wheel_dir(tmp_path)
    assert f"-p{horovod_build.patch_set_id()}" in plan["wheel cache"]


def test_default_cache_folder_is_the_one_build_horovod_uses():
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BOOST_CACHE", "KERAS_BOOST_DEVICE")}
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    out = subprocess.run(["bash", str(SETUP), "--print-plan"], capture_output=True, text=True, env=env,
                         timeout=60).stdout
    expected = horovod_build.wheel_dir(horovod_build.DEFAULT_CACHE, TF, PYTAG)
    assert f"wheel cache: {expected}\n" in out


def test_tf_version_picks_the_tensorflow_and_its_own_venv(tmp_path):
    default = print_plan(tmp_path, tf_version=_versions.DEFAULT_TENSORFLOW)
    assert default["venv"] == str(ROOT / ".venv")
    assert default["tensorflow"] == f"tensorflow-cpu=={_versions.DEFAULT_TENSORFLOW}"
    oldest = _versions.TESTED_TENSORFLOW[0]
    other = print_plan(tmp_path, tf_version=oldest)
    assert other["venv"] == str(ROOT / f".venv-tf{oldest}")
    assert other["tensorflow"] == f"tensorflow-cpu=={oldest}"
    assert other["wheel cache"] == wheel_dir(tmp_path, tf_version=oldest)


def test_tf_version_outside_the_range_is_refused_before_anything_is_installed(tmp_path):
    env = dict(os.environ, TF_VERSION="2.17.1", KERAS_BOOST_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(["bash", str(SETUP), "--print-plan"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 1
    assert (f"TF_VERSION=2.17.1: keras_boost supports TensorFlow {_versions.TENSORFLOW_RANGE}; set TF_VERSION to "
            f"one of {', '.join(_versions.TESTED_TENSORFLOW)}") in result.stderr
    assert not (tmp_path / "cache").exists()


def test_default_is_the_newest_tested_and_inside_the_range():
    tested = sorted(_versions.TESTED_TENSORFLOW, key=lambda v: _versions.version_tuple(v, 3))
    assert _versions.DEFAULT_TENSORFLOW == tested[-1]
    for version in tested:
        assert _versions.tensorflow_problem(version) is None
    minors = [_versions.version_tuple(v) for v in tested]
    low, high = _versions.SUPPORTED_TENSORFLOW
    assert minors[0] == low and minors[-1] == (high[0], high[1] - 1)  # the range's ends are both tested
    assert len(set(minors)) == len(minors) == high[1] - low[1]  # one tested release per minor version


def test_setup_computes_the_patch_set_id_as_build_horovod_does():
    script = (f'cat $(ls "{ROOT}"/keras_boost/horovod_patches/*.patch | LC_ALL=C sort) | sha256sum | cut -c1-8')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30).stdout.strip()
    assert out == horovod_build.patch_set_id()


def test_gpu_machine_plans_tensorflow_with_cuda_and_horovod_with_nccl(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "bin", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\n"
                                             "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)")
    plan = print_plan(tmp_path, fake)
    assert plan["variant"] == "gpu (nvidia-smi lists 2 GPU(s))"
    assert plan["tensorflow"] == f"tensorflow[and-cuda]=={TF}"
    assert plan["horovod"].startswith("NCCL GPU operations (HOROVOD_GPU_OPERATIONS=NCCL")
    assert plan["wheel cache"] == wheel_dir(tmp_path, "-cuda12-nccl")


def test_gpu_machine_after_a_failed_nccl_build_plans_the_cpu_operations_build(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "bin", "GPU 0: Tesla V100-SXM2-16GB (UUID: GPU-a)")
    (tmp_path / "cache").mkdir()
    Path(wheel_dir(tmp_path, "-cuda12-nccl.failed")).touch()
    plan = print_plan(tmp_path, fake)
    assert plan["variant"] == "gpu (nvidia-smi lists 1 GPU(s))"
    assert plan["horovod"].startswith("CPU operations (GPU tensors staged through host memory)")
    assert plan["wheel cache"] == wheel_dir(tmp_path, "-cuda12-cpuops")


@pytest.mark.parametrize("listing, code", [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9),  # no driver
    ("No devices were found", 6),
    ("", 0),
])
def test_nvidia_smi_without_usable_gpus_means_cpu(tmp_path, listing, code):
    plan = print_plan(tmp_path, fake_nvidia_smi(tmp_path / "bin", listing, code))
    assert plan["variant"].startswith("cpu")
    assert plan["tensorflow"] == f"tensorflow-cpu=={TF}"


def test_device_override(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "bin", "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-a)")
    assert print_plan(tmp_path, fake, device="cpu")["tensorflow"] == f"tensorflow-cpu=={TF}"
    assert print_plan(tmp_path, device="gpu")["tensorflow"] == f"tensorflow[and-cuda]=={TF}"


def test_bad_arguments_are_refused(tmp_path):
    result = subprocess.run(["bash", str(SETUP), "--frobnicate"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "unknown argument '--frobnicate'" in result.stderr
    env = dict(os.environ, KERAS_BOOST_DEVICE="tpu")
    result = subprocess.run(["bash", str(SETUP), "--print-plan"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 1 and "KERAS_BOOST_DEVICE must be auto, cpu or gpu, got 'tpu'" in result.stderr


@pytest.mark.parametrize("script", ["setup.sh", "demo.sh", "test.sh", "gpu_check.sh", "venv.sh", "cluster.sh"])
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
