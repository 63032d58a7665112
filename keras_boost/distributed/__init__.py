"""The only door to Horovod: rank, size, collectives and what this build supports.

Without a launcher (no `horovodrun`/`mpirun` in the environment) keras_boost runs as a
single process: `size()` is 1, collectives return their input and Horovod is never
imported, so a plain `python train.py` costs nothing extra and works even where Horovod
is not installed. Under a launcher, `init()` initialises `horovod.tensorflow`; the broken
Keras bindings (`horovod.tensorflow.keras`, `horovod.keras`) are never used.

Collectives are named by their position in the graph being traced (Horovod pairs the
workers' tensors by name), so the names do not depend on how often a worker traced: a
worker that joins an elastic job traces once more than the others, and a new trace starts
from the first name again. Eager collectives use fixed names; they run one at a time.

When counting is switched on (`count_collectives(True)`, or the environment variable
`KERAS_BOOST_COUNT_COLLECTIVES=1` before the first step is traced), every collective a
compiled step runs also increments `allreduce_count()`; tests read it to check how often a
step communicates. Off by default: the production step carries no counter.
"""

import os
import weakref

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
    counter = None  # tf.Variable counting collectives run inside compiled steps (when counting)
    counting = os.environ.get("KERAS_BOOST_COUNT_COLLECTIVES", "") == "1"
    names = weakref.WeakKeyDictionary()  # graph -> collectives named in it so far


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


_SIZE_ENV = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def launch_size():
    """The number of workers of this launch, without initialising Horovod (1 without a launcher).

    Read from Horovod once it is initialised, else from the launcher's environment;
    None when launched but the launcher sets none of the variables read.
    """
    if _state.initialized:
        return size()
    if not launched():
        return 1
    for name in _SIZE_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def is_distributed():
    return size() > 1


def count_collectives(enabled=True):
    """Switches the collective counter on or off for steps traced from now on (for tests)."""
    _state.counting = bool(enabled)


def counting():
    """Whether steps traced now count their collectives."""
    return _state.counting


def _counter():
    if _state.counter is None:
        with tf.init_scope():
            _state.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="keras_boost_collectives")
    return _state.counter


def allreduce_count():
    """Number of collectives run by compiled steps traced while counting was on."""
    return int(_counter().numpy())


def _count(outputs):
    """Ties the collective counter to `outputs` (inside a graph the increment runs with them)."""
    if _state.counting and tf.inside_function():
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            _counter().assign_add(1)
    return outputs


def _name(prefix):
    """`keras_boost.<prefix>.<n>`: n counts the collectives of the graph being traced (eager: fixed)."""
    if not tf.inside_function():
        return f"keras_boost.{prefix}.eager"
    graph = tf.compat.v1.get_default_graph()
    # Branches of a switch_case and loop bodies are graphs of their own: number the
    # collectives of the whole trace, so that every name is unique within the step.
    while getattr(getattr(graph, "outer_graph", None), "outer_graph", None) is not None:
        graph = graph.outer_graph
    index = _state.names.get(graph, 0) + 1
    _state.names[graph] = index
    return f"keras_boost.{prefix}.{index}"


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
