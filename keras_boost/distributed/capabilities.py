"""What this Horovod build and launch support: versions, controllers, GPUs and NCCL."""

import tensorflow as tf

from keras_boost.distributed.gpu import gpus, pinned
from keras_boost.distributed.runtime import _hvd, _state, init, launched


def capabilities():
    """What this build and launch support: versions, controllers, GPUs, NCCL."""
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
        "gpus": visible_gpus,
        "physical_gpus": len(tf.config.list_physical_devices("GPU")),
        "gpu_pinning": None,
        "gpu_allreduce": None,
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
    if launched() or _state.comm is not None:
        init()
        caps["size"] = hvd.size()
        caps["controller"] = "mpi" if hvd.mpi_enabled() else "gloo"
        caps["gpu_pinning"] = pinned()
    return caps


def launch_facts():
    """What Horovod says of this launch, for a stage that picks a collective by it: `mpi` (the MPI
    controller), `nccl` (built with NCCL), `homogeneous` (as many workers on every host), `size`,
    `local_size` and `gpu` (this worker sees a GPU). Without Horovod running: one process."""
    hvd = _hvd()
    gpu = bool(tf.config.list_logical_devices("GPU"))
    if hvd is None:
        return {"mpi": False, "nccl": False, "homogeneous": True, "size": 1, "local_size": 1, "gpu": gpu}
    return {"mpi": bool(hvd.mpi_enabled()), "nccl": bool(hvd.nccl_built()), "homogeneous": bool(hvd.is_homogeneous()),
            "size": hvd.size(), "local_size": hvd.local_size(), "gpu": gpu}
