"""The only door to Horovod: rank, size, collectives and what this build supports.

Without a launcher (no `horovodrun`/`mpirun` in the environment) keras_boost runs as a
single process: `size()` is 1, collectives return their input and Horovod is never
imported, so a plain `python train.py` costs nothing extra and works even where Horovod
is not installed. Under a launcher, `init()` initialises `horovod.tensorflow`; the broken
Keras bindings (`horovod.tensorflow.keras`, `horovod.keras`) are never used.

Collectives are named by their position since the start of the trace being built (Horovod
pairs the workers' tensors by name), so the names do not depend on how often a worker
traced: a worker that joins an elastic job traces once more than the others. Elastic
training restarts the numbering when the workers re-form (`restart_collective_names`).

When counting is switched on (`count_collectives(True)`, or the environment variable
`KERAS_BOOST_COUNT_COLLECTIVES=1` before the first step is traced), every collective a
compiled step runs also increments `allreduce_count()`; tests read it to check how often a
step communicates. Off by default: the production step carries no counter.

On a GPU machine `init()` gives every worker its own GPU before TensorFlow allocates
anything: worker `local_rank` sees only GPU `local_rank` of its host, with memory growth on
(`gpu_for_worker` is the choice, `pin_gpu` applies it). `init(comm=...)` runs Horovod on
an mpi4py communicator (or a list of world ranks), for keras_boost inside a larger MPI
program.

`init(fusion_threshold_mb=..., cycle_time_ms=..., autotune=...)` sets Horovod's tensor
fusion, cycle time and autotuning before `hvd.init()` reads them; `communication()` says
which values are in force (docs/communication.md).
"""

import numbers
import contextlib
import os
import re
import weakref

import tensorflow as tf

# Variables each launcher sets in the processes it starts.
_LAUNCHER_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_INSTALL_HINT = (
    "Horovod with TensorFlow support is required for distributed training: run "
    "./scripts/setup.sh, or build it with HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 "
    "HOROVOD_WITH_GLOO=1 pip install --no-build-isolation horovod==0.28.1"
)


DEFAULT_STALL_TIMEOUT = 600.0
STALL_TIMEOUT_ENV = "KERAS_BOOST_STALL_TIMEOUT"


class _State:
    stall_timeout = DEFAULT_STALL_TIMEOUT
    hvd = None  # horovod.tensorflow once initialised under a launcher
    initialized = False
    counter = None  # tf.Variable counting collectives run inside compiled steps (when counting)
    counting = os.environ.get("KERAS_BOOST_COUNT_COLLECTIVES", "") == "1"
    names = weakref.WeakKeyDictionary()  # the traces whose collectives were numbered
    op_index = 0  # collectives named since the last restart
    boost_step_depth = 0  # > 0 while the boost step is traced (it averages by itself)
    comm = None  # the communicator given to init(comm=...)
    process_sets = {}  # sorted ranks -> the Horovod process set registered for them
    horovod_env = None  # the communication variables as hvd.init() read them
    gpu = None  # {"device", "local_rank", "local_size", "how"} once a GPU is pinned


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


def _check_comm(comm):
    """`comm` for `init`: None, an mpi4py communicator or a non-empty list of distinct world ranks."""
    if comm is None:
        return None
    if hasattr(comm, "Get_rank") and hasattr(comm, "Get_size"):
        return comm
    if isinstance(comm, (list, tuple)) and comm and all(
            isinstance(r, numbers.Integral) and not isinstance(r, bool) and r >= 0 for r in comm) \
            and len(set(comm)) == len(comm):
        return [int(r) for r in comm]
    raise TypeError(f"comm must be None, an mpi4py communicator or a non-empty list of distinct non-negative "
                    f"world ranks, got {comm!r}")


def _stall_timeout_value(value):
    if value is None:  # the argument, then $KERAS_BOOST_STALL_TIMEOUT, then Horovod's own variable, then 600
        name = STALL_TIMEOUT_ENV if STALL_TIMEOUT_ENV in os.environ else "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
        value = os.environ.get(STALL_TIMEOUT_ENV, os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                                                 DEFAULT_STALL_TIMEOUT))
    else:
        name = "stall_timeout"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"`{name}` must be a non-negative number of seconds (0: never), got {value!r}.")
    return seconds


# Horovod 0.28.1's defaults (horovod/common/operations.cc, BackgroundThreadLoop): what it uses
# when the variables are unset.
HOROVOD_FUSION_THRESHOLD_DEFAULT = 128 * 1024 * 1024  # bytes
HOROVOD_CYCLE_TIME_DEFAULT_MS = 1.0  # 0 with HOROVOD_ENABLE_XLA_OPS=1
_MIB = 1024 * 1024
_COMMUNICATION_VARIABLES = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_AUTOTUNE",
                            "HOROVOD_AUTOTUNE_LOG", "HOROVOD_ENABLE_XLA_OPS")


def _check_non_negative(name, value, unit):
    if value is None:
        return None
    allowed = f"None or a non-negative number ({unit})"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")
    return value


def communication_env(fusion_threshold_mb=None, cycle_time_ms=None, autotune=None, autotune_log=None):
    """The Horovod variables `init(...)` sets for these options (None: leave the variable alone).

    Pure and validating: `fusion_threshold_mb` (MiB, as horovodrun's --fusion-threshold-mb)
    becomes HOROVOD_FUSION_THRESHOLD in bytes, `cycle_time_ms` HOROVOD_CYCLE_TIME,
    `autotune` HOROVOD_AUTOTUNE ("1"/"0"), `autotune_log` (a path) HOROVOD_AUTOTUNE_LOG.
    """
    env = {}
    if _check_non_negative("fusion_threshold_mb", fusion_threshold_mb, "MiB; 0 switches fusion off") is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(round(fusion_threshold_mb * _MIB)))
    if _check_non_negative("cycle_time_ms", cycle_time_ms, "milliseconds") is not None:
        env["HOROVOD_CYCLE_TIME"] = repr(float(cycle_time_ms))
    if autotune is not None:
        if not isinstance(autotune, bool):
            raise TypeError(f"`autotune` must be None or a bool (True or False), got {autotune!r} "
                            f"({type(autotune).__name__}).")
        env["HOROVOD_AUTOTUNE"] = "1" if autotune else "0"
    if autotune_log is not None:
        if not isinstance(autotune_log, (str, os.PathLike)) or not os.fspath(autotune_log):
            raise TypeError(f"`autotune_log` must be None or a file path (str or os.PathLike), got {autotune_log!r} "
                            f"({type(autotune_log).__name__}).")
        env["HOROVOD_AUTOTUNE_LOG"] = os.fspath(autotune_log)
    return env


def init(comm=None, stall_timeout=None, *, fusion_threshold_mb=None, cycle_time_ms=None, autotune=None,
         autotune_log=None):
    """Initialises Horovod when launched by `horovodrun`/`mpirun` (or given `comm`); a no-op otherwise.

    Idempotent. Dynamic process sets are enabled so that AdaSum can create its groups
    after initialisation. Under a launcher on a machine with GPUs, the worker is pinned to
    GPU `local_rank` of its host (see `pin_gpu`); call `init()` first thing, before
    building a model, so that TensorFlow has not claimed every GPU yet.

    Args:
        comm: None (all processes of the launch), or an mpi4py communicator (e.g. a
            `MPI.COMM_WORLD.Split(...)` of a larger MPI program), or a list of
            `MPI_COMM_WORLD` ranks: keras_boost then trains on those processes only, and
            `size()`/`rank()` count within them. Only the processes in `comm` call
            `init(comm=comm)`. Needs Horovod built with MPI and an MPI launch
            (`mpirun`, `srun`, or `horovodrun --mpi`).
        stall_timeout: seconds after which a worker that waits for the others (or that
            stopped calling collectives) ends the job with a message naming the ranks and
            where each one is (`keras_boost.distributed.watchdog`, and Horovod's stall
            inspector: `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`). None: `$KERAS_BOOST_STALL_TIMEOUT`,
            else `$HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`, else 600 s; 0: never. Only the first
            call (the one that initialises) sets it.
        fusion_threshold_mb: Horovod's tensor fusion buffer in MiB (`HOROVOD_FUSION_THRESHOLD`,
            horovodrun's `--fusion-threshold-mb`): tensors ready in the same cycle are sent
            together up to this size; 0 sends each tensor alone. Horovod's default: 128.
        cycle_time_ms: how long Horovod's background thread waits between cycles of
            negotiation and fusion (`HOROVOD_CYCLE_TIME`, `--cycle-time-ms`); longer means
            fuller buffers, shorter means less latency. Horovod's default: 1 ms.
        autotune: True lets Horovod tune the fusion threshold and cycle time (and its
            hierarchical/caching switches) while training (`HOROVOD_AUTOTUNE`, `--autotune`);
            False switches a launcher's autotuning off.
        autotune_log: a CSV file where rank 0 logs the autotuning samples
            (`HOROVOD_AUTOTUNE_LOG`, `--autotune-log-file`).

    The communication options are checked at every call (`TypeError`/`ValueError`). None
    keeps what the launcher or the environment set. They take effect in the call that
    initialises Horovod; a later call that asks for other values than those in force is
    a `RuntimeError`. Without a launcher there is no Horovod to configure: they are only
    checked. `communication()` gives the values in force.
    """
    comm = _check_comm(comm)
    settings = communication_env(fusion_threshold_mb, cycle_time_ms, autotune, autotune_log)
    if _state.initialized:
        if comm is not None and comm is not _state.comm and comm != _state.comm:
            raise RuntimeError("keras_boost.distributed is already initialised with another communicator; "
                               "call init(comm=...) once, before anything else uses keras_boost")
        in_force = _state.horovod_env or {}
        differing = {k: v for k, v in settings.items() if _state.hvd is not None and in_force.get(k) != v}
        if differing:
            raise RuntimeError(f"Horovod is already initialised, with {communication()}; the communication options "
                               f"({differing}) take effect only in the first init() call: call "
                               "keras_boost.distributed.init(...) first thing, before building or compiling a model")
        return
    _state.stall_timeout = _stall_timeout_value(stall_timeout)
    if launched() or comm is not None:
        os.environ.update(settings)  # before hvd.init(), which reads them
        _state.horovod_env = {name: os.environ.get(name) for name in _COMMUNICATION_VARIABLES}
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
        if _state.stall_timeout > 0:  # set before hvd.init(), which reads them
            shutdown = max(1, int(round(_state.stall_timeout)))
            os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(shutdown)
            os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(stall_check_seconds(shutdown))
        from keras_boost.distributed.hosts import check_host_addresses

        problem = check_host_addresses()  # Gloo would end the job with "connect [127.0.1.1]: refused"
        if problem:
            raise RuntimeError(f"keras_boost: {problem}")
        hvd = _import_horovod()
        if comm is None:
            hvd.init()
        else:
            hvd.init(comm=comm)
        _state.hvd = hvd
        _state.comm = comm
        pin_gpu(hvd.local_rank(), hvd.local_size())
    _state.initialized = True
    if _state.counting:
        _counter()  # made now, not inside a step's first trace (which would make tf.function trace it again)


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
    how = "scheduler-assigned" if len(gpus) == 1 and local_size > 1 else "local_rank"
    _state.gpu = {"device": choice.name, "local_rank": local_rank, "local_size": local_size, "how": how}
    return choice


def stall_check_seconds(shutdown):
    """Horovod's stall warning period for a shutdown time (warns before it shuts down)."""
    return max(1, min(60, int(shutdown) // 2))


def stall_timeout():
    """The stall timeout in seconds (0: never); see `init`."""
    init()
    return _state.stall_timeout


def _leading_int(text):
    """C's strtol(text, nullptr, 10), as Horovod reads its integer variables (0 when none)."""
    match = re.match(r"\s*([+-]?\d+)", text)
    return int(match.group(1)) if match else 0


def _leading_float(text):
    """C's strtof(text, nullptr) for decimal numbers, as Horovod reads HOROVOD_CYCLE_TIME (0 when none)."""
    match = re.match(r"\s*([+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)", text)
    return float(match.group(1)) if match else 0.0


def communication():
    """Horovod's tensor fusion, cycle time and autotuning in force, for `keras-boost info`.

    Read as Horovod 0.28.1 reads them at `hvd.init()`: from the environment (what
    `init(...)`, horovodrun's options or the user set; as it was at `hvd.init()` once
    Horovod runs), else Horovod's defaults (128 MiB fusion buffer, 1 ms cycle, or 0 ms with
    `HOROVOD_ENABLE_XLA_OPS=1`; no autotuning). With autotuning on these are the starting
    values; Horovod changes them while training.

    Returns:
        dict with "fusion_threshold_bytes", "fusion_threshold_mb", "cycle_time_ms",
        "autotune", "autotune_log" (a path or None), "horovod" (whether Horovod runs in
        this process) and "source" (for each value: "environment" or "Horovod default").
    """
    init()
    read = _state.horovod_env if _state.hvd is not None and _state.horovod_env is not None else os.environ
    env = {k: v for k, v in read.items() if k in _COMMUNICATION_VARIABLES and v is not None}
    source = {}
    if "HOROVOD_FUSION_THRESHOLD" in env:
        fusion, source["fusion_threshold"] = _leading_int(env["HOROVOD_FUSION_THRESHOLD"]), "environment"
    else:
        fusion, source["fusion_threshold"] = HOROVOD_FUSION_THRESHOLD_DEFAULT, "Horovod default"
    if "HOROVOD_CYCLE_TIME" in env:
        cycle, source["cycle_time"] = _leading_float(env["HOROVOD_CYCLE_TIME"]), "environment"
    else:
        xla = env.get("HOROVOD_ENABLE_XLA_OPS", "").strip().lower() in ("1", "true", "y", "yes", "on")
        cycle, source["cycle_time"] = (0.0 if xla else HOROVOD_CYCLE_TIME_DEFAULT_MS), "Horovod default"
    autotune = "HOROVOD_AUTOTUNE" in env and _leading_int(env["HOROVOD_AUTOTUNE"]) > 0
    source["autotune"] = "environment" if "HOROVOD_AUTOTUNE" in env else "Horovod default"
    return {"fusion_threshold_bytes": fusion, "fusion_threshold_mb": fusion / _MIB, "cycle_time_ms": cycle,
            "autotune": autotune, "autotune_log": env.get("HOROVOD_AUTOTUNE_LOG") if autotune else None,
            "horovod": _state.hvd is not None, "source": source}


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


def _ask(question, alone):
    """Horovod's answer to `question` (a function name), or `alone` in a single process."""
    hvd = _hvd()
    return alone if hvd is None else getattr(hvd, question)()


def size():
    return _ask("size", 1)


def rank():
    return _ask("rank", 0)


def local_rank():
    return _ask("local_rank", 0)


def local_size():
    return _ask("local_size", 1)


def cross_rank():
    """This worker's host among the hosts (Horovod's cross rank; 0 in a single process)."""
    return _ask("cross_rank", 0)


def cross_size():
    """The number of hosts with a worker of this local rank (Horovod's cross size; 1 in a single process)."""
    return _ask("cross_size", 1)


def is_homogeneous():
    """Whether every host runs the same number of workers (True in a single process)."""
    return bool(_ask("is_homogeneous", True))


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


@contextlib.contextmanager
def boost_step_scope():
    """Marks the tracing of the boost step, whose optimizer calls must not average again."""
    _state.boost_step_depth += 1
    try:
        yield
    finally:
        _state.boost_step_depth -= 1


def in_boost_step():
    return _state.boost_step_depth > 0


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
    """`keras_boost.<prefix>.<n>`: n counts from the last restart of the numbering.

    Horovod pairs the workers' tensors by name. The numbering restarts at the start of every
    trace of the train step (`start_trace`), whatever a worker traced before, and when
    elastic training re-forms the workers (`restart_collective_names`), so a worker that
    just joined and the survivors name their collectives alike.
    """
    _state.op_index += 1
    return f"keras_boost.{prefix}.{_state.op_index}"


def start_trace():
    """Restarts the numbering once per traced graph (call at the start of the train step)."""
    if tf.inside_function():
        graph = tf.compat.v1.get_default_graph()
        if graph not in _state.names:  # once per trace, even with steps_per_execution > 1
            _state.names[graph] = True
            _state.op_index = 0


def restart_collective_names():
    """Restarts the numbering; elastic training calls it on every worker when the workers re-form."""
    _state.op_index = 0


def grouped_allreduce(tensors, average=True, process_set=None):
    """Averages (or sums) a list of tensors across workers in one fused collective per dtype.

    Horovod fuses only tensors of one dtype (a grouped allreduce of mixed dtypes is an
    error), so a list that mixes dtypes takes one collective per dtype, in order of first
    appearance. bfloat16 tensors, which Horovod 0.28.1 cannot reduce, take one grouped
    allgather instead (`_bfloat16_allreduce`).
    """
    tensors = list(tensors)
    hvd = _hvd()
    if hvd is None or not tensors:
        return tensors
    kwargs = {} if process_set is None else {"process_set": process_set}
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(_values_dtype(t), []).append(i)
    reduced = [None] * len(tensors)
    for dtype, positions in by_dtype.items():
        group = [tensors[i] for i in positions]
        if dtype == tf.bfloat16:
            outputs = _bfloat16_allreduce(hvd, group, average, kwargs)
        else:
            outputs = _count(list(hvd.grouped_allreduce(group, op=_average_or_sum(hvd, average), name=_name("allreduce"), **kwargs)))
        for i, output in zip(positions, outputs):
            reduced[i] = output
    return reduced


def allreduce_each(tensors, average=True, process_set=None):
    """Averages (or sums) each tensor in a collective of its own, counted as one reduction.

    Each tensor goes to Horovod as soon as the backward pass has produced it, as Horovod's
    `DistributedGradientTape` does, so the first gradients travel while the rest are still
    computed; Horovod's fusion buffer still packs the tensors that are ready in the same
    cycle into one allreduce. bfloat16 tensors take `grouped_allreduce`'s allgather.
    """
    tensors = list(tensors)
    hvd = _hvd()
    if hvd is None or not tensors:
        return tensors
    kwargs = {} if process_set is None else {"process_set": process_set}
    op = _average_or_sum(hvd, average)
    base = _name("allreduce")
    reduced = [None] * len(tensors)
    halves = [i for i, t in enumerate(tensors) if _values_dtype(t) == tf.bfloat16]
    if halves:
        for i, output in zip(halves, _bfloat16_allreduce(hvd, [tensors[i] for i in halves], average, kwargs)):
            reduced[i] = output
    rest = [i for i in range(len(tensors)) if reduced[i] is None]
    outputs = [hvd.allreduce(tensors[i], op=op, name=f"{base}.{n}", **kwargs) for n, i in enumerate(rest)]
    if outputs:
        _count(outputs)
    for i, output in zip(rest, outputs):
        reduced[i] = output
    return reduced


def _average_or_sum(hvd, average):
    return hvd.Average if average else hvd.Sum


def _values_dtype(tensor):
    return tensor.values.dtype if isinstance(tensor, tf.IndexedSlices) else tensor.dtype


def _bfloat16_allreduce(hvd, tensors, average, kwargs):
    """The mean (or sum) of bfloat16 tensors across workers, identical on every worker.

    Horovod 0.28.1's allreduce takes uint8, int8, int32, int64, float16, float32 and float64
    only; its allgather takes int16. Every worker gathers the others' bfloat16 bit patterns
    (as int16, one grouped allgather) and sums them in float64 in rank order (no overflow,
    no order dependence), then rounds the result to bfloat16. Received bytes per worker:
    (workers - 1) x half the float32 size, against 2 (workers - 1) / workers x the float32
    size for a ring allreduce of float32: fewer below 4 workers, as many at 4, more beyond.
    """
    dense = [tf.convert_to_tensor(t) for t in tensors]
    flat = [tf.reshape(tf.bitcast(t, tf.int16), [1, -1]) for t in dense]
    gathered = _count(list(hvd.grouped_allgather(flat, name=_name("allgather_bf16"), **kwargs)))
    reduced = []
    for tensor, rows in zip(dense, gathered):
        values = tf.cast(tf.cast(tf.bitcast(rows, tf.bfloat16), tf.float32), tf.float64)
        total = tf.reduce_sum(values, axis=0)
        if average:
            total = total / tf.cast(tf.shape(values)[0], tf.float64)
        reduced.append(tf.reshape(tf.cast(tf.cast(total, tf.float32), tf.bfloat16), tf.shape(tensor)))
    return reduced


def reducescatter(tensor, process_set=None):
    """Sums a 1-D tensor across the workers of `process_set` (default: all) and keeps this worker's part.

    The length must be a multiple of the number of workers in the set; the i-th worker of
    the set, in rank order, gets the i-th of the equal parts.
    """
    hvd = _hvd()
    if hvd is None:
        return tf.convert_to_tensor(tensor)
    kwargs = {} if process_set is None else {"process_set": process_set}
    return _count(hvd.reducescatter(tensor, op=hvd.Sum, name=_name("reducescatter"), **kwargs))


def allreduce(tensor, average=True, process_set=None):
    return grouped_allreduce([tensor], average=average, process_set=process_set)[0]


def adasum_allreduce(tensors, process_set=None, device=""):
    """Horovod's native Adasum of each tensor across workers (MPI builds only).

    `device` is Horovod's `device_dense`: "/CPU:0" runs the CPU Adasum (MPI, host memory)
    even on GPU tensors; "" lets Horovod run its hierarchical GPU Adasum on GPU tensors
    when it is built with NCCL.
    """
    hvd = horovod()
    kwargs = {} if process_set is None else {"process_set": process_set}
    if device:  # the input on that device too: Horovod picks its GPU or CPU Adasum by the input's device
        with tf.device(device):
            tensors = [tf.identity(t) for t in tensors]
    reduced = [hvd.allreduce(t, op=hvd.Adasum, name=_name("adasum"), device_dense=device, **kwargs)
               for t in tensors]
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


def allgather_object(obj, name):
    """Every worker's picklable `obj`, as a list in rank order (eager; `name` the same on every worker)."""
    hvd = _hvd()
    if hvd is None:
        return [obj]
    return list(hvd.allgather_object(obj, name=name))


def add_process_set(ranks):
    """The Horovod process set over `ranks`, registered on first use (every worker must ask in the same order).

    Asking again for the same ranks returns the set already registered (Horovod refuses a
    second registration), so several stages and models may share a process set.
    """
    hvd = horovod()
    key = tuple(sorted(int(r) for r in ranks))
    known = _state.process_sets.get(key)
    if known is not None and known.process_set_id is not None:
        return known
    registered = hvd.add_process_set(list(key))
    _state.process_sets[key] = registered
    return registered


def barrier():
    """Returns once every worker has called it (eager)."""
    hvd = _hvd()
    if hvd is not None:
        hvd.allreduce(tf.constant(0.0), name=_name("barrier")).numpy()


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
        caps["gpu_pinning"] = dict(_state.gpu) if _state.gpu else None
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
