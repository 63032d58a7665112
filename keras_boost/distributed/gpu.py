"""One GPU per worker: which GPU a worker uses (`gpu_for_worker`), pinning it (`pin_gpu`), and the GPUs seen (`gpus`)."""

import numbers
import os

import tensorflow as tf


_pinned = None  # {"device", "local_rank", "local_size", "how"} once a GPU is pinned


def gpu_for_worker(local_rank, local_size, gpus, cuda_visible_devices=None):
    """The GPU a worker uses: `gpus[local_rank]`; None when `gpus` is empty.

    Pure: no TensorFlow, no Horovod. One GPU per worker is the only layout keras_boost
    runs: more workers on a host than GPUs would make some share a GPU (and its memory).

    Args:
        local_rank: this worker's rank among the workers on its host (0-based).
        local_size: the number of workers on its host.
        gpus: the GPUs this process sees, in order (e.g. `tf.config.list_physical_devices("GPU")`).
        cuda_visible_devices: the `CUDA_VISIBLE_DEVICES` variable, or None when unset. When
            it names exactly one device and the process sees exactly one GPU, the launcher
            has already given each worker its own GPU (`srun --gpus-per-task=1`, a
            scheduler's GPU binding): that GPU is used whatever `local_size` is.

    Returns:
        An element of `gpus`, or None.

    Raises:
        ValueError: `local_size < 1`, `local_rank` outside `[0, local_size)`, or more
            workers on this host than GPUs visible to them.
    """
    for name, value in (("local_rank", local_rank), ("local_size", local_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if local_size < 1:
        raise ValueError(f"local_size must be >= 1, got {local_size}")
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank must be in [0, local_size={local_size}), got {local_rank}")
    gpus = list(gpus)
    if not gpus:
        return None
    preassigned = cuda_visible_devices is not None and len(
        [d for d in cuda_visible_devices.split(",") if d.strip()]) == 1
    if preassigned and len(gpus) == 1:
        return gpus[0]
    if local_size > len(gpus):
        raise ValueError(
            f"{local_size} workers run on this host but only {len(gpus)} GPU(s) are visible to them: keras_boost "
            f"gives each worker its own GPU (worker local_rank uses GPU local_rank). Start at most {len(gpus)} "
            f"workers per host (horovodrun -np N -H host:{len(gpus)},...), or set KERAS_BOOST_PIN_GPU=0 to manage "
            "the devices yourself"
        )
    return gpus[local_rank]


def pin_gpu(local_rank, local_size):
    """Makes GPU `gpu_for_worker(...)` the only GPU TensorFlow uses here, with memory growth on.

    A no-op without GPUs or with `KERAS_BOOST_PIN_GPU=0`. Returns the pinned device or
    None. Must run before TensorFlow initialises its GPUs (any tensor or variable does);
    `init()` calls it right after Horovod starts.
    """
    if os.environ.get("KERAS_BOOST_PIN_GPU", "1") == "0":
        return None
    gpus = tf.config.list_physical_devices("GPU")
    choice = gpu_for_worker(local_rank, local_size, gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if choice is None:
        return None
    try:
        tf.config.set_visible_devices([choice], "GPU")
        tf.config.experimental.set_memory_growth(choice, True)
    except RuntimeError as error:  # TensorFlow's GPUs are initialised already
        if tf.config.get_visible_devices("GPU") != [choice]:
            raise RuntimeError(
                f"keras_boost could not pin worker local_rank {local_rank} to {choice.name}: TensorFlow has already "
                "initialised every GPU in this process. Call keras_boost.distributed.init() at the start of the "
                "script, before creating any model, tensor or variable"
            ) from error
    global _pinned
    how = "scheduler-assigned" if len(gpus) == 1 and local_size > 1 else "local_rank"
    _pinned = {"device": choice.name, "local_rank": local_rank, "local_size": local_size, "how": how}
    return choice


def pinned():
    """The GPU `pin_gpu` gave this worker: {"device", "local_rank", "local_size", "how"}, or None."""
    return dict(_pinned) if _pinned else None


def gpus():
    """Names and models of the GPUs this process sees (after pinning: its own GPU only)."""
    found = []
    for device in tf.config.list_physical_devices("GPU"):
        if device not in tf.config.get_visible_devices("GPU"):
            continue
        details = tf.config.experimental.get_device_details(device)
        found.append({"device": device.name, "name": details.get("device_name", "GPU"),
                      "compute_capability": details.get("compute_capability")})
    return found
