"""The only door to Horovod: rank, size, collectives and what this build supports.

Without a launcher (no `horovodrun`/`mpirun` in the environment) keras_boost runs as a
single process: `size()` is 1, collectives return their input and Horovod is never
imported, so a plain `python train.py` costs nothing extra and works even where Horovod
is not installed. Under a launcher, `init()` initialises `horovod.tensorflow`; the broken
Keras bindings (`horovod.tensorflow.keras`, `horovod.keras`) are never used.

Every collective issued through this module inside a compiled step also increments
`allreduce_count()`, a variable that tests and the boost logs read to check how often a
step communicates.
"""

import os

import tensorflow as tf

# Variables each launcher sets in the processes it starts.
_LAUNCHER_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_INSTALL_HINT = (
    "Horovod with TensorFlow support is required for distributed training: run "
    "./scripts/setup.sh, or build it with HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 "
    "HOROVOD_WITH_GLOO=1 pip install --no-build-isolation horovod==0.28.1"
)


class _State:
    hvd = None  # horovod.tensorflow once initialised under a launcher
    initialized = False
    counter = None  # tf.Variable counting collectives run inside compiled steps
    op_index = 0
    boost_step_depth = 0  # > 0 while the boost step is traced (it averages by itself)


_state = _State()


def launched():
    """Whether this process was started by `horovodrun` or `mpirun`."""
    return any(name in os.environ for name in _LAUNCHER_ENV)


def _import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:  # pragma: no cover - depends on the install
        raise RuntimeError(f"{_INSTALL_HINT} ({error})") from error
    return hvd


def init():
    """Initialises Horovod when launched by `horovodrun`/`mpirun`; a no-op otherwise.

    Idempotent. Dynamic process sets are enabled so that AdaSum can create its groups
    after initialisation.
    """
    if _state.initialized:
        return
    if launched():
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
        hvd = _import_horovod()
        hvd.init()
        _state.hvd = hvd
    with tf.init_scope():
        _state.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="keras_boost_collectives")
    _state.initialized = True


def _hvd():
    init()
    return _state.hvd


def horovod():
    """The initialised `horovod.tensorflow` module; raises when not under a launcher."""
    hvd = _hvd()
    if hvd is None:
        raise RuntimeError(
            "This needs processes started by a launcher, e.g. "
            "`horovodrun -np 2 -H localhost:2 python train.py`; this process was started "
            f"without one. {_INSTALL_HINT}"
        )
    return hvd


def size():
    hvd = _hvd()
    return 1 if hvd is None else hvd.size()


def rank():
    hvd = _hvd()
    return 0 if hvd is None else hvd.rank()


def local_rank():
    hvd = _hvd()
    return 0 if hvd is None else hvd.local_rank()


def local_size():
    hvd = _hvd()
    return 1 if hvd is None else hvd.local_size()


def is_distributed():
    return size() > 1


def allreduce_count():
    """Number of collectives issued through this module by compiled steps so far."""
    init()
    return int(_state.counter.numpy())


def _count(outputs):
    """Ties the collective counter to `outputs` (inside a graph the increment runs with them)."""
    if tf.inside_function():
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            _state.counter.assign_add(1)
    return outputs


def _name(prefix):
    _state.op_index += 1
    return f"keras_boost.{prefix}.{_state.op_index}"


class boost_step_scope:  # noqa: N801 - used as a context manager
    """Marks the tracing of the boost step, whose optimizer calls must not average again."""

    def __enter__(self):
        _state.boost_step_depth += 1

    def __exit__(self, *exc):
        _state.boost_step_depth -= 1


def in_boost_step():
    return _state.boost_step_depth > 0


def reset_collective_names():
    """Restarts the numbering of collective names; call at the same point on every worker.

    Horovod pairs the workers' tensors by name. Restarting at the start of every trace of
    the train step makes the names independent of how often a worker traced (a worker
    that joins an elastic job traces once more than the others, for instance).
    """
    _state.op_index = 0


def grouped_allreduce(tensors, average=True, process_set=None):
    """Averages (or sums) a list of tensors across workers in one fused collective."""
    tensors = list(tensors)
    hvd = _hvd()
    if hvd is None or not tensors:
        return tensors
    op = hvd.Average if average else hvd.Sum
    kwargs = {} if process_set is None else {"process_set": process_set}
    reduced = hvd.grouped_allreduce(tensors, op=op, name=_name("allreduce"), **kwargs)
    return _count(list(reduced))


def allreduce(tensor, average=True, process_set=None):
    return grouped_allreduce([tensor], average=average, process_set=process_set)[0]


def adasum_allreduce(tensors, process_set=None):
    """Horovod's native Adasum of each tensor across workers (MPI builds only)."""
    hvd = horovod()
    kwargs = {} if process_set is None else {"process_set": process_set}
    reduced = [hvd.allreduce(t, op=hvd.Adasum, name=_name("adasum"), **kwargs) for t in tensors]
    return _count(reduced)


def allgather(tensor, process_set=None):
    """Concatenates `tensor` from every worker along axis 0, in rank order."""
    hvd = _hvd()
    if hvd is None:
        return tf.convert_to_tensor(tensor)
    kwargs = {} if process_set is None else {"process_set": process_set}
    return _count(hvd.allgather(tensor, name=_name("allgather"), **kwargs))


def broadcast_variables(variables, root_rank=0):
    """Sets every variable to its value on `root_rank` (eager; call between steps)."""
    hvd = _hvd()
    if hvd is None:
        return
    for index, variable in enumerate(variables):
        value = getattr(variable, "value", variable)
        variable.assign(hvd.broadcast(value, root_rank, name=f"keras_boost.bcast.{index}"))


def broadcast_object(obj, root_rank=0):
    """Returns rank `root_rank`'s Python object on every worker."""
    hvd = _hvd()
    if hvd is None:
        return obj
    return hvd.broadcast_object(obj, root_rank=root_rank, name=_name("bcast_object"))


def add_process_set(ranks):
    """Registers a Horovod process set over `ranks` (all workers must call it in the same order)."""
    return horovod().add_process_set(list(ranks))


def barrier():
    """Returns once every worker has called it (eager)."""
    hvd = _hvd()
    if hvd is not None:
        hvd.allreduce(tf.constant(0.0), name=_name("barrier")).numpy()


def capabilities():
    """What this build and launch support: versions, controllers, Adasum."""
    import keras

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
    if launched():
        init()
        caps["size"] = hvd.size()
        caps["controller"] = "mpi" if hvd.mpi_enabled() else "gloo"
        caps["native_adasum"] = native_adasum_available(hvd.size())
    return caps


def native_adasum_available(groups):
    """Horovod's Adasum runs only on an MPI launch and a power-of-two number of groups."""
    hvd = _hvd()
    return bool(hvd is not None and hvd.mpi_enabled() and groups >= 1 and groups & (groups - 1) == 0)
