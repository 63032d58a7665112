"""What this Horovod build and launch support: versions, controllers, GPUs, NCCL and Adasum."""

import tensorflow as tf

from keras_boost.distributed.gpu import gpus, pinned
from keras_boost.distributed.runtime import _hvd, _state, init, launched


def capabilities():
    """What this build and launch support: versions, controllers, GPUs, NCCL, Adasum."""
    import keras

    visible_gpus = gpus()
    caps = {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "horovod": None,
        "mpi_built": False,
        "gloo_built": False,
        "nccl_built": False,
        "launched": launched(),
        "controller": None,
        "size": 1,
        "native_adasum": False,
        "gpus": visible_gpus,
        "physical_gpus": len(tf.config.list_physical_devices("GPU")),
        "gpu_pinning": None,
        "gpu_allreduce": None,
        "gpu_adasum": None,
    }
    try:
        import horovod
        import horovod.tensorflow as hvd
    except ImportError:
        return caps
    caps.update(
        horovod=horovod.__version__,
        mpi_built=bool(hvd.mpi_built()),
        gloo_built=bool(hvd.gloo_built()),
        nccl_built=bool(hvd.nccl_built()),
    )
    if visible_gpus:
        caps["gpu_allreduce"] = "NCCL" if caps["nccl_built"] else "host memory (Horovod built with CPU operations)"
        caps["gpu_adasum"] = ("hierarchical (NCCL within a node, MPI Adasum across nodes) when device_number is "
                              "the GPUs per node under MPI, CPU Adasum otherwise") if caps["nccl_built"] \
            else "CPU Adasum (host memory)"
    if launched() or _state.comm is not None:
        init()
        caps["size"] = hvd.size()
        caps["controller"] = "mpi" if hvd.mpi_enabled() else "gloo"
        caps["native_adasum"] = native_adasum_available(hvd.size())
        caps["gpu_pinning"] = pinned()
    return caps


def gpu_adasum_available(groups, device_number):
    """Whether Horovod's hierarchical GPU Adasum computes keras_boost's AdaSum over `groups` groups.

    Horovod runs Adasum on GPU tensors as an NCCL sum inside each node, then Adasum
    across nodes (MPI), then an NCCL broadcast back: that is AdaSum over the groups when
    the groups are the nodes (`device_number == local_size`, every node the same size),
    their number is a power of two, and Horovod was built with NCCL and runs under MPI.
    """
    hvd = _hvd()
    if hvd is None or not tf.config.list_logical_devices("GPU"):
        return False
    return adasum_gpu_plan(groups, device_number, hvd.local_size(), hvd.size(), bool(hvd.nccl_built()),
                           bool(hvd.mpi_enabled()), bool(hvd.is_homogeneous()))


def adasum_gpu_plan(groups, device_number, local_size, size, nccl_built, mpi_enabled, homogeneous):
    """Pure rule of `gpu_adasum_available` (testable without GPUs)."""
    return bool(nccl_built and mpi_enabled and homogeneous and device_number == local_size
                and groups * device_number == size and groups >= 1 and groups & (groups - 1) == 0)


def native_adasum_available(groups):
    """Horovod's Adasum runs only on an MPI launch and a power-of-two number of groups."""
    hvd = _hvd()
    return bool(hvd is not None and hvd.mpi_enabled() and groups >= 1 and groups & (groups - 1) == 0)
