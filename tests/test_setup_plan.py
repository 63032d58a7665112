"""scripts/setup.sh --print-plan: the install variant chosen from nvidia-smi, without installing anything.

A fake `nvidia-smi` on PATH stands in for a GPU machine's driver tool.
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup.sh"
PYTAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def fake_nvidia_smi(folder, listing, exit_code=0):
    """A `nvidia-smi` script in `folder` that prints `listing` for `-L` and exits with `exit_code`."""
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'END'\n{listing}\nEND\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def print_plan(tmp_path, fake_bin=None, device=None):
    path = os.environ["PATH"] if fake_bin is None else f"{fake_bin}:{os.environ['PATH']}"
    if fake_bin is None:  # a PATH without any nvidia-smi
        path = ":".join(p for p in path.split(":") if not (Path(p) / "nvidia-smi").exists())
    env = dict(os.environ, PATH=path, KERAS_BOOST_CACHE=str(tmp_path / "cache"))
    env.pop("KERAS_BOOST_DEVICE", None)
    if device is not None:
        env["KERAS_BOOST_DEVICE"] = device
    result = subprocess.run(["bash", str(SETUP), "--print-plan"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.strip().splitlines())


def wheel_dir(tmp_path, suffix=""):
    return str(tmp_path / "cache" / f"horovod-0.28.1-tf2.18.1-{PYTAG}-{os.uname().machine}{suffix}")


def test_cpu_machine_keeps_the_cpu_install_and_the_existing_cache_key(tmp_path):
    plan = print_plan(tmp_path)
    assert plan["variant"].startswith("cpu (no NVIDIA GPU")
    assert plan["tensorflow"] == "tensorflow-cpu==2.18.1"
    assert plan["horovod"] == "CPU operations (TensorFlow + MPI + Gloo)"
    assert plan["wheel cache"] == wheel_dir(tmp_path)  # the folder setup.sh has always used: no rebuild


def test_default_cache_folder_is_unchanged_on_cpu():
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BOOST_CACHE", "KERAS_BOOST_DEVICE")}
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    out = subprocess.run(["bash", str(SETUP), "--print-plan"], capture_output=True, text=True, env=env,
                         timeout=60).stdout
    expected = f"{os.path.expanduser('~')}/.cache/keras_boost/horovod-0.28.1-tf2.18.1-{PYTAG}-{os.uname().machine}"
    assert f"wheel cache: {expected}\n" in out


def test_gpu_machine_plans_tensorflow_with_cuda_and_horovod_with_nccl(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "bin", "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\n"
                                             "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)")
    plan = print_plan(tmp_path, fake)
    assert plan["variant"] == "gpu (nvidia-smi lists 2 GPU(s))"
    assert plan["tensorflow"] == "tensorflow[and-cuda]==2.18.1"
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
    assert plan["tensorflow"] == "tensorflow-cpu==2.18.1"


def test_device_override(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "bin", "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-a)")
    assert print_plan(tmp_path, fake, device="cpu")["tensorflow"] == "tensorflow-cpu==2.18.1"
    assert print_plan(tmp_path, device="gpu")["tensorflow"] == "tensorflow[and-cuda]==2.18.1"


def test_bad_arguments_are_refused(tmp_path):
    result = subprocess.run(["bash", str(SETUP), "--frobnicate"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "unknown argument '--frobnicate'" in result.stderr
    env = dict(os.environ, KERAS_BOOST_DEVICE="tpu")
    result = subprocess.run(["bash", str(SETUP), "--print-plan"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 1 and "KERAS_BOOST_DEVICE must be auto, cpu or gpu, got 'tpu'" in result.stderr


@pytest.mark.parametrize("script", ["setup.sh", "demo.sh", "test.sh", "gpu_check.sh"])
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
