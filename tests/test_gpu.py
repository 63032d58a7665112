"""GPU support: one GPU per worker, NCCL reporting, mixed precision choice, AdaSum's GPU variant.

The choices are pure functions tested here without a GPU. The tests marked `requires_gpu`
run real workers on GPUs and are skipped (with the reason) on machines without one;
scripts/gpu_check.sh runs them on a GPU machine.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from keras_boost import distributed
from keras_boost.precision import choose_policy
from keras_boost.stages import adasum_ops
from tests.launch import run_ok

ROOT = Path(__file__).resolve().parent.parent
GPUS = tf.config.list_physical_devices("GPU")
requires_gpu = pytest.mark.skipif(not GPUS, reason="needs an NVIDIA GPU (none visible to TensorFlow here)")
requires_2_gpus = pytest.mark.skipif(len(GPUS) < 2, reason=f"needs 2 GPUs, {len(GPUS)} visible here")

EIGHT = [f"/physical_device:GPU:{i}" for i in range(8)]


# ------------------------------------------------------------ one GPU per worker
@pytest.mark.parametrize("local_rank, local_size, expected", [
    (0, 1, 0), (0, 8, 0), (3, 8, 3), (7, 8, 7), (1, 2, 1), (1, 4, 1),
])
def test_worker_uses_gpu_local_rank(local_rank, local_size, expected):
    assert distributed.gpu_for_worker(local_rank, local_size, EIGHT) == EIGHT[expected]


def test_no_gpu_means_no_pinning():
    assert distributed.gpu_for_worker(0, 1, []) is None
    assert distributed.gpu_for_worker(5, 16, []) is None  # many CPU workers on one host are fine


@pytest.mark.parametrize("local_size, gpus", [(9, 8), (2, 1), (16, 8), (3, 2)])
def test_more_workers_than_gpus_is_an_error_naming_both(local_size, gpus):
    with pytest.raises(ValueError, match=rf"^{local_size} workers run on this host but only {gpus} GPU\(s\) are"):
        distributed.gpu_for_worker(0, local_size, EIGHT[:gpus])


def test_scheduler_assigned_gpu_is_used_as_is():
    # srun --gpus-per-task=1: each of 8 workers on the host sees one GPU, named by CUDA_VISIBLE_DEVICES
    only = ["/physical_device:GPU:0"]
    assert distributed.gpu_for_worker(5, 8, only, cuda_visible_devices="5") == only[0]
    # but CUDA_VISIBLE_DEVICES listing 2 devices with only one visible is no such assignment
    with pytest.raises(ValueError, match="8 workers run on this host but only 1 GPU"):
        distributed.gpu_for_worker(5, 8, only, cuda_visible_devices="4,5")
    with pytest.raises(ValueError, match="2 workers run on this host but only 1 GPU"):
        distributed.gpu_for_worker(1, 2, only, cuda_visible_devices=None)
    # a subset of GPUs made visible: still one per local rank, in their order
    assert distributed.gpu_for_worker(1, 2, EIGHT[:2], cuda_visible_devices="4,6") == EIGHT[1]


@pytest.mark.parametrize("local_rank, local_size, error, match", [
    (2, 2, ValueError, r"local_rank must be in \[0, local_size=2\), got 2"),
    (-1, 2, ValueError, r"local_rank must be in \[0, local_size=2\), got -1"),
    (0, 0, ValueError, "local_size must be >= 1, got 0"),
    (0.0, 2, TypeError, "local_rank must be an integer, got 0.0"),
    (0, True, TypeError, "local_size must be an integer, got True"),
])
def test_bad_local_rank_or_size(local_rank, local_size, error, match):
    with pytest.raises(error, match=match):
        distributed.gpu_for_worker(local_rank, local_size, EIGHT)


def test_pinning_is_off_without_gpus_or_when_disabled(monkeypatch):
    if not GPUS:
        assert distributed.pin_gpu(0, 4) is None  # no GPU: nothing to pin, no error for 4 workers
    monkeypatch.setenv("KERAS_BOOST_PIN_GPU", "0")
    assert distributed.pin_gpu(0, 64) is None


def test_import_keeps_tensorflow_uninitialised():
    """`import keras_boost` must leave TensorFlow's devices alone so that init() can still pin a GPU."""
    code = ("import keras_boost, keras_boost.app.cli, keras_boost.app.training\n"
            "from tensorflow.python.eager import context\n"
            "import sys; sys.exit(1 if context.context()._context_handle is not None else 0)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_workers_under_horovodrun_see_their_own_gpu_or_none():
    """On CPU: no GPU, no pinning, collectives work. On a GPU machine: worker r sees only GPU r."""
    np_ = 2 if len(GPUS) != 1 else 1
    found = run_ok("gpu_pinning.py", np=np_, controller="gloo", timeout=240, gpus=True)
    for rank, result in found.items():
        assert result["sum"] == 64 * 64 * np_
        assert result["physical"] == len(GPUS)
        if not GPUS:
            assert result["visible"] == [] and result["pinning"] is None and result["gpu_allreduce"] is None
            assert "CPU" in result["placed_on"]
        else:
            assert result["visible"] == [f"/physical_device:GPU:{result['local_rank']}"]
            assert result["logical"] == ["/device:GPU:0"] and "GPU:0" in result["placed_on"]
            assert result["pinning"]["local_rank"] == result["local_rank"]
            assert result["gpu_allreduce"] == ("NCCL" if result["nccl_built"] else
                                               "host memory (Horovod built with CPU operations)")


# ------------------------------------------------------------------- info
def test_info_shows_gpus_and_their_allreduce():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    text = subprocess.run([sys.executable, "-m", "keras_boost.app.cli", "info"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)
    caps = json.loads(subprocess.run([sys.executable, "-m", "keras_boost.app.cli", "info", "--json"], capture_output=True,
                                     text=True, env=env, timeout=120, cwd=ROOT).stdout)
    assert caps["physical_gpus"] == len(GPUS) and len(caps["gpus"]) == len(GPUS)
    if GPUS:
        assert "GPU allreduce     " + caps["gpu_allreduce"] in text.stdout
        assert caps["gpu_allreduce"] == ("NCCL" if caps["nccl_built"] else
                                         "host memory (Horovod built with CPU operations)")
    else:
        assert "GPUs              none (CPU only)" in text.stdout
        assert caps["gpu_allreduce"] is None and caps["gpu_pinning"] is None


# -------------------------------------------------------------- precision
@pytest.mark.parametrize("precision, level, capabilities, expected", [
    ("auto", "O1", [], "float32"),                       # CPU: float32 stays the default
    ("auto", "O2", [], "float32"),
    ("auto", "O0", [(9, 0)], "float32"),                 # O0 stays plain Keras
    ("auto", None, [(9, 0)], "float32"),
    ("auto", "O1", [(9, 0)], "mixed_bfloat16"),          # H100/H200
    ("auto", "O2", [(8, 0)], "mixed_bfloat16"),          # A100
    ("auto", "O1", [(7, 0)], "mixed_float16"),           # V100: float16 tensor cores, dynamic loss scale
    ("auto", "O1", [(7, 5)], "mixed_float16"),           # T4
    ("auto", "O1", [(8, 0), (7, 0)], "mixed_float16"),   # the weakest GPU decides
    ("auto", "O1", [(6, 1)], "float32"),                 # Pascal: no tensor cores
    ("auto", "O1", [None], "float32"),                   # unknown capability
    ("mixed_float16", "O0", [], "mixed_float16"),        # an explicit policy wins
    ("float32", "O2", [(9, 0)], "float32"),
])
def test_precision_choice(precision, level, capabilities, expected):
    assert choose_policy(precision, level, capabilities) == expected


@pytest.mark.parametrize("level, capabilities, cpu_bf16, expected", [
    ("O1", [], True, "mixed_bfloat16"),       # a CPU with AVX512-BF16 or AMX
    ("O2", [], True, "mixed_bfloat16"),
    ("O0", [], True, "float32"),              # O0 stays plain Keras
    ("O1", [], False, "float32"),             # bfloat16 emulated: many times slower
    ("O1", [(7, 0)], True, "mixed_float16"),  # a GPU decides, not the host CPU
    ("O1", [(6, 1)], True, "float32"),
])
def test_precision_choice_on_cpus(level, capabilities, cpu_bf16, expected):
    assert choose_policy("auto", level, capabilities, cpu_bf16=cpu_bf16) == expected


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    from keras_boost.precision import cpu_flags, cpu_has_native_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert "avx512_bf16" in cpu_flags(str(info)) and cpu_has_native_bf16(cpu_flags(str(info)))
    assert cpu_has_native_bf16({"amx_bf16", "amx_tile"})
    assert not cpu_has_native_bf16({"avx2", "avx512f", "avx512_vnni"})
    assert cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_auto_precision_on_cpus_needs_onednn(onednn):
    """bfloat16 only where oneDNN runs it: with TF_ENABLE_ONEDNN_OPTS=0 TensorFlow emulates it
    even on an AVX512-BF16 CPU (14x slower steps measured here), so `auto` keeps float32.

    Each setting in its own process: TensorFlow reads the variable once per process.
    """
    if GPUS:
        pytest.skip("a GPU decides the precision here, not the CPU")
    from keras_boost.precision import cpu_has_native_bf16

    code = ("from keras_boost.precision import onednn_enabled, resolve_precision; "
            "print(onednn_enabled(), resolve_precision('auto', 'O1'), resolve_precision('auto', 'O0'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": onednn, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    enabled, o1, o0 = out.stdout.split()[-3:]
    assert enabled == str(onednn == "1")
    assert o0 == "float32"
    assert o1 == ("mixed_bfloat16" if onednn == "1" and cpu_has_native_bf16() else "float32")


@pytest.mark.parametrize("native_bf16, onednn, expected", [
    (True, True, "mixed_bfloat16"),
    (True, False, "float32"),  # TensorFlow would emulate bfloat16 in Eigen
    (False, True, "float32"),
])
def test_auto_precision_on_a_cpu_with_and_without_native_bf16_and_onednn(monkeypatch, native_bf16, onednn, expected):
    """The rule of `resolve_precision` on CPUs this machine may not be (the test above checks this CPU for real)."""
    from keras_boost import precision

    if GPUS:
        pytest.skip("a GPU decides the precision here, not the CPU")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(precision, "onednn_enabled", lambda: onednn)
    assert precision.resolve_precision("auto", "O1") == expected
    assert precision.resolve_precision("auto", "O0") == "float32"


def test_bad_precision():
    with pytest.raises(ValueError, match=r"precision must be one of \('auto', 'float32', 'mixed_float16', "
                                         r"'mixed_bfloat16'\), got 'float16'"):
        choose_policy("float16", "O1", [])


def test_mixed_float16_gets_the_dynamic_loss_scale():
    import keras

    from keras_boost import DynamicLossScale
    from tests.helpers import compile_sgd, mlp

    keras.config.set_dtype_policy(choose_policy("auto", "O1", [(7, 0)]))
    model = compile_sgd(mlp())
    assert isinstance(model.boost_step.stage("loss_scale"), DynamicLossScale)


# ------------------------------------------------------------------ AdaSum
@pytest.mark.parametrize("groups, device_number, local_size, size, nccl, mpi, homogeneous, expected", [
    (2, 8, 8, 16, True, True, True, True),      # 2 nodes x 8 GPUs, a group per node
    (4, 8, 8, 32, True, True, True, True),
    (1, 8, 8, 8, True, True, True, True),
    (3, 8, 8, 24, True, True, True, False),     # 3 nodes: not a power of two
    (16, 1, 8, 16, True, True, True, False),    # groups inside nodes: NCCL would sum distinct groups
    (2, 8, 8, 16, False, True, True, False),    # no NCCL build
    (2, 8, 8, 16, True, False, True, False),    # Gloo
    (2, 8, 8, 16, True, True, False, False),    # nodes of different sizes
])
def test_hierarchical_gpu_adasum_only_where_it_is_adasum_over_nodes(groups, device_number, local_size, size, nccl,
                                                                   mpi, homogeneous, expected):
    assert adasum_ops.adasum_gpu_plan(groups, device_number, local_size, size, nccl, mpi, homogeneous) is expected


def test_no_gpu_adasum_on_cpu():
    if not GPUS:
        assert adasum_ops.gpu_adasum_available(2, 1) is False


# ------------------------------------------------------------- GPU machines
@requires_gpu
def test_gpu_single_process_trains_with_auto_precision():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    args = ["train", "--dataset", "synthetic", "--train-samples", "256", "--epochs", "1", "--batch-size", "32",
            "--steps-per-epoch", "3", "--level", "O1", "--json"]
    result = subprocess.run([sys.executable, "-m", "keras_boost.app.cli", *args], capture_output=True, text=True,
                            env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    capability = tuple(tf.config.experimental.get_device_details(GPUS[0])["compute_capability"])
    assert summary["precision"] == choose_policy("auto", "O1", [capability])


@requires_2_gpus
def test_two_gpu_workers_train_in_sync():
    found = run_ok("train_equivalence.py", np=2, controller="gloo", timeout=600, gpus=True)
    assert found[0]["digest"] == found[1]["digest"]
    assert found[0]["diff"] < 1e-4
