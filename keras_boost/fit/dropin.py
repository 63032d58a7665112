"""What makes `BoostModel` a drop-in for `keras.Model` in ordinary Keras code.

- A distributed optimizer: the compiled optimizer's `apply` (and so `apply_gradients`)
  averages the gradients across workers when a user's own `train_step` calls it, as
  Horovod's `DistributedOptimizer` does; the boost step, which averages by itself, passes
  through.
- No XLA around collectives: Horovod's ops have no XLA kernels, so the train function of
  a multi-worker run is compiled without XLA (one warning); evaluate and predict keep it.
- Work on one rank alone: `evaluate()` called by a script gives the worker's own metrics
  and runs no collective (as Horovod's Keras `evaluate`), so `if rank == 0:
  model.evaluate(...); model.save(...)` and then a barrier, a broadcast or another fit ends
  by itself; predict and save run no collective at all. `evaluate(across_workers=True)`,
  fit's start and `distributed.barrier()` meet in one rendezvous: workers that reached
  different ones raise `CollectiveMismatch` at once, naming what each rank called.
- Logs: `verbose="auto"` is one line per epoch under a launcher; `verbose=1` there (or
  with the output going to a file or a pipe) prints whole progress lines, at most one every
  10 seconds and never over 160 characters (a launcher's prefix fits beside them), instead
  of a bar that redraws itself
  (`LineProgressLogger`); the boost scalars are kept out of both (they stay in the logs,
  the History and TensorBoard).
- Files: a script written for one machine writes the same paths on every worker. On
  several workers `BoostModel.save` and `save_weights` write each file whole (a file of
  their own, then renamed into place), so workers saving one path on a shared file system
  do not collide and every host with a disk of its own gets its copy; Keras' `CSVLogger`
  and `TensorBoard` given the same path on several workers write on the lowest of them
  alone; a `BackupAndRestore` is the job's (`keras_boost.callbacks.BackupAndRestore`:
  rank 0 writes it and sends what it restores to every worker), given on every worker or
  on none (`one_writer_per_file`).
"""

import contextlib
import logging
import os
import socket

import keras
import numpy as np
import tensorflow as tf

from keras_boost import distributed, _warnings

logger = logging.getLogger("keras_boost")



# ------------------------------------------------------------ distributed optimizer
def average_gradients(grads):
    """Averages a list of gradients (None kept, IndexedSlices made dense) across workers."""
    positions = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in positions]
    reduced = distributed.grouped_allreduce(dense, average=True)
    out = list(grads)
    for i, g in zip(positions, reduced):
        out[i] = g
    return out


def make_distributed_optimizer(optimizer):
    """Makes `optimizer.apply` / `apply_gradients` average the gradients across workers.

    Called by `BoostModel.compile` on the compiled optimizer, so the usual Keras
    `train_step` (a tape, then `self.optimizer.apply_gradients(...)` or
    `self.optimizer.apply(...)`) stays in sync on many workers. Inside the boost step
    the gradients are already averaged and `apply` passes them through unchanged. In a
    single process it changes nothing. The optimizer's class, configuration and saved
    state are unchanged.

    Returns:
        The same optimizer.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if optimizer.__dict__.get("_keras_boost_distributed"):
        return optimizer
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        grads = list(grads)
        if distributed.size() > 1 and not distributed.in_boost_step():
            grads = average_gradients(grads)
        return original(grads, trainable_variables)

    apply.__doc__ = original.__doc__
    # Instance attributes, outside Keras' tracking: the class (and so saving) is unchanged.
    object.__setattr__(optimizer, "apply", apply)
    object.__setattr__(optimizer, "_keras_boost_distributed", True)
    return optimizer


# ----------------------------------------------------------------------------- XLA
_JIT_WARNED = []


@contextlib.contextmanager
def without_jit_for_collectives(model):
    """Builds the train function without XLA on many workers (Horovod ops have no XLA kernel)."""
    if distributed.size() > 1 and not model.run_eagerly and model.jit_compile:
        if not _JIT_WARNED:
            _JIT_WARNED.append(True)
            _warnings.warn(
                f"jit_compile is on, but on {distributed.size()} workers the train step runs Horovod "
                "collectives, which XLA cannot compile: the train step runs without XLA (evaluate and "
                "predict keep it). compile(jit_compile=False) silences this warning.",
            )
        saved = model.jit_compile  # resolved; the public setter takes it back unchanged
        model.jit_compile = False
        try:
            yield
        finally:
            model.jit_compile = saved
    else:
        yield


# ---------------------------------------------------------------- rank-0 evaluate
_ALONE_WARNED = []


def alone_results(results, error):
    """This worker's own metric results once the others have finished; re-raises other errors.

    In the Horovod idiom `if rank == 0: model.evaluate(...)` at the end of a script the
    other workers exit, which shuts Horovod down: summing the metric states across workers
    then fails with Horovod's shutdown error, and rank 0 gets its own results (one warning)
    instead of a crash.
    """
    if "shut down" not in str(error):
        raise error
    if not _ALONE_WARNED:
        _ALONE_WARNED.append(True)
        _warnings.warn("the other workers have finished (Horovod is shut down): these metrics are this "
                       f"worker's own (rank {distributed.rank()}), not averaged")
    return {n: float(np.asarray(keras.ops.convert_to_numpy(v))) if np.ndim(v) == 0 else v
            for n, v in results.items()}


# --------------------------------------------------------------------------- files
# The suffixes Keras' save and save_weights take for one file (a directory, `zipped=False`,
# and sharded weights are written as Keras writes them).
_WHOLE_FILE_SUFFIXES = (".weights.h5", ".keras", ".h5")


def write_whole(filepath, write):
    """Runs `write(path)` so that `filepath` is replaced whole, on several workers.

    A script written for one machine saves the same path on every worker (a
    `ModelCheckpoint`, a `model.save(...)` at its end). Writing one file from several
    processes collides on a shared file system: h5py's lock fails on the second writer
    (`BlockingIOError: unable to lock file`), and a zip written by two processes at once
    can be cut. So under a launcher with several workers each one writes a file of its own
    beside the target (`.NAME.HOST-PID.partial.SUFFIX`) and renames it into place: the
    target is always one worker's whole file (every worker holds the same weights), and a
    host with a disk of its own gets its copy, as in one process. One process, remote
    paths (`gs://...`), directories and sharded weights are written as Keras writes them.
    """
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
    suffix = next((s for s in _WHOLE_FILE_SUFFIXES if path is not None and path.endswith(s)), None)
    if distributed.size() <= 1 or suffix is None or "://" in path:
        return write(filepath)
    directory, name = os.path.split(path)
    partial = os.path.join(directory, f".{name[:-len(suffix)]}.{socket.gethostname()}-{os.getpid()}.partial{suffix}")
    try:
        result = write(partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return result


# Keras' callbacks that write one path: (class, the attribute that holds the path).
_LOGGERS = ((keras.callbacks.CSVLogger, "filename"), (keras.callbacks.TensorBoard, "log_dir"))


def written_paths(callbacks):
    """What each callback of `callbacks` writes, as the workers tell each other when `fit` starts.

    A list parallel to `callbacks`: `["backup", dir, save_freq, delete_checkpoint]` for a
    `BackupAndRestore` (Keras' or keras_boost's), `[class name, path]` for a `CSVLogger` or
    a `TensorBoard`, None for the others (a `ModelCheckpoint` saves through
    `BoostModel.save`, which `write_whole` makes safe).
    """
    found = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            found.append(["backup", str(callback.backup_dir), callback.save_freq, bool(callback.delete_checkpoint)])
            continue
        kind = next(((cls, attribute) for cls, attribute in _LOGGERS if isinstance(callback, cls)), None)
        found.append(None if kind is None else [kind[0].__name__, str(getattr(callback, kind[1]))])
    return found


def one_writer_per_file(callbacks, gathered, rank):
    """Leaves each file that several workers' callbacks write to one writer, in place in `callbacks`.

    `gathered`: every worker's `written_paths(...)`, in rank order (one allgather when `fit`
    starts, `data_sync.check_agreement`); `rank`: this worker's. Each worker decides from
    the same lists, so all decide alike:

    - a `CSVLogger` or `TensorBoard` path that several workers give is written by the
      lowest of them alone (the others get a callback that does nothing): every worker
      logs the same averaged numbers, and two would double every CSV row and every
      TensorBoard point;
    - a `BackupAndRestore` is the job's: given with one directory on every worker it runs
      as `keras_boost.callbacks.BackupAndRestore` (rank 0 writes, atomically, and sends
      what it restores to every worker, so the directory need not be shared by the
      hosts); each worker with a directory of its own keeps its own. A backup that some
      workers have and others lack is a `ValueError`: they would resume at different epochs.

    Returns the lines to print (rank 0 prints them), one per kind of change.
    """
    from keras_boost.fit.callbacks import BackupAndRestore

    size = len(gathered)
    holders = {}  # (kind, path): the ranks that give it, in order
    for worker, paths in enumerate(gathered):
        for entry in paths:
            if entry is not None and worker not in holders.setdefault((entry[0], entry[1]), []):
                holders[(entry[0], entry[1])].append(worker)
    backups = {path: ranks for (kind, path), ranks in holders.items() if kind == "backup"}
    having = {r for ranks in backups.values() for r in ranks}
    for path, ranks in backups.items():
        if (len(ranks) > 1 or len(having) < size) and len(ranks) < size:
            lacking = [r for r in range(size) if r not in ranks]
            raise ValueError(
                f"BackupAndRestore({path!r}) is given to fit on rank(s) {ranks} but not on rank(s) {lacking}: the "
                "workers would resume at different epochs. Give the same BackupAndRestore on every worker (keras_boost "
                "writes the backup on rank 0 alone and sends what it restores to every worker), or on none.")
    lines, logged, converted = [], [], []
    for index, (callback, entry) in enumerate(zip(callbacks, gathered[rank])):
        if entry is None:
            continue
        kind, path = entry[0], entry[1]
        ranks = holders[(kind, path)]
        if kind == "backup":
            if len(ranks) == size and type(callback) is keras.callbacks.BackupAndRestore:
                callbacks[index] = BackupAndRestore(path, save_freq=entry[2], delete_checkpoint=entry[3])
                converted.append(f"{type(callback).__name__}({path!r})")
        elif len(ranks) > 1:
            logged.append((f"{kind}({path!r})", ranks[0]))
            if rank != ranks[0]:
                callbacks[index] = keras.callbacks.Callback()
    if logged:
        writers = {first for _, first in logged}
        where = f"rank {writers.pop()}" if len(writers) == 1 else "the lowest rank that gives each"
        lines.append(f"keras_boost: {', '.join(name for name, _ in logged)} write on {where} alone: all {size} workers "
                     "log the same averaged numbers, and each would write every row and point again; give each worker "
                     "a path of its own to keep them on every worker")
    if converted:
        lines.append(f"keras_boost: {', '.join(converted)} runs as keras_boost.callbacks.BackupAndRestore: rank 0 "
                     "writes the backup, atomically, and sends what it restores to every worker")
    return lines


# ---------------------------------------------------------------------------- logs
class BoostProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' progress bar without the boost scalars (they stay in the logs and the History)."""

    def __init__(self, verbose, hidden):
        super().__init__()
        self._verbose_setting = verbose
        self._hidden = set(hidden)

    def set_params(self, params):
        super().set_params(dict(params, verbose=self._verbose_setting))

    def _shown(self, logs):
        if not logs:
            return logs
        return {k: v for k, v in logs.items() if k not in self._hidden}

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, self._shown(logs))

    def on_test_batch_end(self, batch, logs=None):
        super().on_test_batch_end(batch, self._shown(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, self._shown(logs))

    def on_test_end(self, logs=None):
        super().on_test_end(self._shown(logs))


class LineProgressLogger(keras.callbacks.Callback):
    """`verbose=1` as whole lines, for a log that a launcher or a file keeps rather than a terminal.

    Keras' progress bar redraws one line with carriage returns and backspaces, which a log
    keeps as one line of every redraw (one line an epoch, tens of thousands of characters). This
    prints a whole line at most every `interval` seconds while an epoch (or an `evaluate`,
    or a `predict`) runs, and one at its end: the batch, the time, the metrics, never over
    `width` characters (the metrics that do not fit are left out of the progress lines; the
    epoch's last line drops what it must and says how many).
    """

    def __init__(self, hidden=(), interval=10.0, width=160, clock=None, write=None):
        super().__init__()
        self.hidden, self.interval, self.width = set(hidden), float(interval), int(width)
        import time

        self._clock = clock or time.monotonic
        self._write = write or (lambda line: print(line, flush=True))
        self._in_fit = False
        self._start = self._last = 0.0

    def _metrics(self, logs):
        parts = []
        for name, value in (logs or {}).items():
            if name in self.hidden:
                continue
            try:
                parts.append(f"{name}: {float(value):.4g}")
            except (TypeError, ValueError):
                continue
        return parts

    def _line(self, head, logs):
        parts = self._metrics(logs)
        line = head + "".join(f" - {p}" for p in parts)
        dropped = 0
        while len(line) > self.width and parts:
            parts.pop()
            dropped += 1
            line = head + "".join(f" - {p}" for p in parts) + f" (+{dropped} more)"
        return line[:self.width]

    def _begin(self):
        self._start = self._last = self._clock()

    def _progress(self, what, batch, total, logs):
        now = self._clock()
        if now - self._last < self.interval:
            return
        self._last = now
        steps = f"{batch + 1}/{total}" if total else f"{batch + 1}"
        self._write(self._line(f"{what} {steps} - {now - self._start:.0f}s", logs))

    def _end(self, what, total, logs):
        seconds = self._clock() - self._start
        head = f"{what} {total}/{total} - {seconds:.0f}s" if total else f"{what} - {seconds:.0f}s"
        if total:
            head += f" - {1000 * seconds / total:.0f}ms/step"
        self._write(self._line(head, logs))

    def on_train_begin(self, logs=None):
        self._in_fit = True

    def on_train_end(self, logs=None):
        self._in_fit = False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = f"Epoch {epoch + 1}/{self.params.get('epochs', 1)}"
        self._seen = 0
        self._begin()

    def on_train_batch_end(self, batch, logs=None):
        self._seen = batch + 1
        self._progress(self._epoch, batch, self.params.get("steps"), logs)

    def on_epoch_end(self, epoch, logs=None):
        self._end(self._epoch, self.params.get("steps") or self._seen, logs)

    def on_test_begin(self, logs=None):
        if not self._in_fit:
            self._seen = 0
            self._begin()

    def on_test_batch_end(self, batch, logs=None):
        if not self._in_fit:
            self._seen = batch + 1
            self._progress("Evaluate", batch, self.params.get("steps"), logs)

    def on_test_end(self, logs=None):
        if not self._in_fit:
            self._end("Evaluate", self.params.get("steps") or self._seen, logs)

    def on_predict_begin(self, logs=None):
        self._seen = 0
        self._begin()

    def on_predict_batch_end(self, batch, logs=None):
        self._seen = batch + 1
        self._progress("Predict", batch, self.params.get("steps"), None)

    def on_predict_end(self, logs=None):
        self._end("Predict", self.params.get("steps") or self._seen, None)


def _writes_to_a_terminal():
    import sys

    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def launcher_verbose(verbose):
    """'auto' is one line per epoch (2) under any launcher; an explicit verbose=1 keeps the bar.

    Whether stdout is a terminal says nothing there: Open MPI gives every rank a
    pseudo-terminal, and horovodrun prefixes every line with `[rank]<stdout>:`, so a bar
    that redraws itself would print one mangled line per batch.
    """
    if verbose == "auto" and distributed.launched():
        return 2
    return verbose


def progress_callbacks(model, callbacks, verbose):
    """(callbacks, verbose) for Keras: the boost progress bar in place of Keras' own."""
    if isinstance(callbacks, keras.callbacks.CallbackList):  # fit's validation: fit's own list
        return callbacks, verbose
    verbose = launcher_verbose(verbose)
    step = getattr(model, "boost_step", None)
    hidden = set(step.log_keys()) if step is not None else set()  # the boost scalars: in the logs, not the bar
    callbacks = list(callbacks or [])
    if verbose == 0 or any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        return callbacks, verbose
    if verbose in (1, True) and (distributed.launched() or not _writes_to_a_terminal()):
        callbacks.append(LineProgressLogger(hidden))  # a launcher's pty or pipe, a file: whole lines
    else:
        callbacks.append(BoostProgbarLogger(verbose, hidden))
    return callbacks, 0
