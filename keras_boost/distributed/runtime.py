"""The Horovod runtime: whether this process was launched, `init`, rank and size, the stall timeout and the communication settings.

Without a launcher keras_boost runs as a single process: `size()` is 1 and Horovod is
never imported. Under a launcher, `init()` initialises `horovod.tensorflow`. The package
`keras_boost.distributed` re-exports everything public here (its docstring tells the whole
story); the other modules of the package read `_state`.
"""

import numbers
import contextlib
import os
import threading
import re
import weakref

import tensorflow as tf

from keras_boost.distributed.gpu import pin_gpu


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
    op_index = 0  # eager collectives named since the last restart
    comm = None  # the communicator given to init(comm=...)
    process_sets = {}  # sorted ranks -> the Horovod process set registered for them
    horovod_env = None  # the communication variables as hvd.init() read them
    process_sets_wanted = []  # what asked for process sets before Horovod started (want_process_sets)
    dynamic_process_sets = False  # whether Horovod runs with dynamic process sets


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
         autotune_log=None, process_sets=None):
    """Initialises Horovod when launched by `horovodrun`/`mpirun` (or given `comm`); a no-op otherwise.

    Idempotent. Dynamic process sets are enabled when a stage that groups workers asks, so
    that it can create its groups after initialisation. Under a launcher on a machine with GPUs, the worker is pinned to
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
            where each one is (`keras_boost.fit.watchdog`, and Horovod's stall
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
        process_sets: whether Horovod runs with dynamic process sets
            (`HOROVOD_DYNAMIC_PROCESS_SETS`), which the stages that group workers need
            (`Stage.uses_process_sets`): they register process sets after Horovod starts. They cost
            every step: each Horovod cycle also agrees on the process-set table (on a
            1 Gbit/s link, 2 hosts, the demo model: 650 against 767 images/s per worker,
            docs/communication.md). None (default): on when `HOROVOD_DYNAMIC_PROCESS_SETS`
            is set to 1 in the environment, or when such a stage was made before Horovod
            started (`want_process_sets`); off otherwise. True / False: on / off.

    The communication options are checked at every call (`TypeError`/`ValueError`). None
    keeps what the launcher or the environment set. They take effect in the call that
    initialises Horovod; a later call that asks for other values than those in force is
    a `RuntimeError`. Without a launcher there is no Horovod to configure: they are only
    checked. `communication()` gives the values in force.
    """
    comm = _check_comm(comm)
    settings = communication_env(fusion_threshold_mb, cycle_time_ms, autotune, autotune_log)
    if process_sets is not None and not isinstance(process_sets, bool):
        raise TypeError(f"`process_sets` must be None or a bool (True or False), got {process_sets!r} "
                        f"({type(process_sets).__name__}).")
    if _state.initialized:
        if process_sets and _state.hvd is not None and not _state.dynamic_process_sets:
            raise RuntimeError("Horovod is already initialised without dynamic process sets; process_sets=True "
                               "takes effect only in the first init() call: call "
                               "keras_boost.distributed.init(process_sets=True) first thing")
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
        _state.dynamic_process_sets = _dynamic_process_sets(process_sets)
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1" if _state.dynamic_process_sets else "0"
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
        if _state.stall_timeout > 0 and comm is None:
            from keras_boost.distributed.progress_store import serve_store

            serve_store(hvd.rank(), hvd.size(), hvd.local_size(), hvd.broadcast_object)
    _state.initialized = True
    if _state.counting:
        _counter()  # made now, not inside a step's first trace (which would make tf.function trace it again)


def elastic_launch():
    """Whether this process was started by `horovodrun` in elastic mode (`--min-np`/discovery)."""
    return launched() and os.environ.get("HOROVOD_ELASTIC") == "1"


def horovod_version():
    """The installed Horovod's version, or None where it cannot be imported."""
    try:
        import horovod
    except ImportError:  # pragma: no cover - a launch without Horovod has one worker
        return None
    return horovod.__version__


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


class _Tracing(threading.local):
    boost_step_depth = 0  # > 0 while this thread traces the boost step (it averages by itself)
    op_index = 0  # collectives this thread named since the start of the trace it builds


_tracing = _Tracing()  # per thread: the steps of a stage's branches are traced in the background


@contextlib.contextmanager
def boost_step_scope():
    """Marks the tracing of the boost step (in this thread), whose optimizer calls must not average again."""
    _tracing.boost_step_depth += 1
    try:
        yield
    finally:
        _tracing.boost_step_depth -= 1


def in_boost_step():
    return _tracing.boost_step_depth > 0


def _counter():
    """The variable counting the collectives of compiled steps (made on first use, outside any trace)."""
    if _state.counter is None:
        with tf.init_scope():
            _state.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="keras_boost_collectives")
    return _state.counter


def _dynamic_process_sets(asked):
    """`init`'s decision: the argument, else the environment, else whether a stage asked."""
    if asked is not None:
        return asked
    if "HOROVOD_DYNAMIC_PROCESS_SETS" in os.environ:
        return os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"].strip().lower() in ("1", "true", "y", "yes", "on")
    return bool(_state.process_sets_wanted)


def want_process_sets(what):
    """Called when a stage that registers Horovod process sets is made (`Stage.uses_process_sets`):
    Horovod will start with dynamic process sets.

    A no-op without a launcher. Raises ValueError when Horovod already runs without them,
    naming `what` and the fix, so that the error comes when the stage is made, not at its
    first step.
    """
    if not launched() and _state.comm is None:
        return
    if not _state.initialized:
        if what not in _state.process_sets_wanted:
            _state.process_sets_wanted.append(what)
        return
    if _state.hvd is not None and not _state.dynamic_process_sets:
        raise ValueError(
            f"{what} registers Horovod process sets after Horovod starts, and Horovod was started without "
            "dynamic process sets (they cost every step, so keras_boost switches them on only when asked). Call "
            "keras_boost.distributed.init(process_sets=True) at the start of the script (keras-boost train does "
            "when the run asks for such a stage), or set HOROVOD_DYNAMIC_PROCESS_SETS=1")


def dynamic_process_sets():
    """Whether Horovod runs with dynamic process sets (False without a launcher)."""
    return bool(_state.initialized and _state.hvd is not None and _state.dynamic_process_sets)
