"""Elastic training of a BoostModel on Horovod: survive workers that die or join.

Horovod's elastic mode (`horovodrun --gloo --min-np ... --max-np ... --host-discovery-script
...`) re-forms the job when the set of workers changes: every surviving worker rolls back
to the state it last *committed*, Horovod shuts down and re-initialises with the new
workers, rank 0 broadcasts its state to everyone (new workers included) and training
resumes. `horovod.tensorflow.keras.elastic` / `horovod.keras.elastic` do this for Keras 2
only (they are broken under Keras 3, see docs/reliability.md); this module does it for a
`BoostModel` with `horovod.tensorflow`'s low-level ops:

    BoostModelState   what is committed, restored and synchronised: every model variable
                      (the boost state layer included), every optimizer variable, and
                      Python attributes (epoch, batch, samples, history, your own).
    run               the retry loop (`horovod.common.elastic.run_fn`) with the error
                      translation and the Keras/keras_boost resets Keras 3 needs.
    CommitStateCallback
                      commits every `batches_per_commit` batches and at each epoch end,
                      keeping `state.epoch` / `state.batch` / `state.samples` current.
    fit_elastic       the whole recipe: shards the data for the current workers, resumes
                      from the committed epoch *and* position inside it, returns the
                      per-epoch logs.

Example (train.py, started with
`horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script ./discover.sh --gloo python train.py`):

    >>> distributed.init()
    >>> model = build_and_compile_boost_model()
    >>> state = keras_boost.elastic.BoostModelState(model)
    >>> history = keras_boost.elastic.fit_elastic(model, x, y, state, batch_size=32, epochs=10,
    ...                                           batches_per_commit=20)

Without a launcher everything runs once in the process (no Horovod import); under a
non-elastic launch (`horovodrun -np 2 ...`) state is synchronised once and a failing
worker ends the run, as usual.
"""

import logging

import keras
import numpy as np
import tensorflow as tf

from keras_boost import distributed
from keras_boost.distributed import elastic_support
from keras_boost._validation import check_int
from keras_boost.core.contract import StepContext
from keras_boost.core.state import training_variables
from keras_boost.fit.callbacks import BroadcastGlobalVariablesCallback

logger = logging.getLogger("keras_boost")

# Substrings of the TensorFlow error message of a Horovod collective that failed because a
# peer went away ("Horovod has been shut down. ...", a Gloo connection/timeout error). Only
# message lines count, not the "File ..." lines of the traceback TensorFlow appends.
_HOROVOD_FAILURE_WORDS = ("Horovod", "gloo", "Gloo")


def _failure_lines(error):
    lines = (line.strip() for line in str(getattr(error, "message", error)).splitlines())
    return [line for line in lines if line and not line.startswith("File ")]


elastic_launch = distributed.elastic_launch


def _build_for_sync(model):
    """Creates every variable that is otherwise created lazily, so all workers sync the same list.

    A worker that joins later builds its model from scratch; its optimizer and boost state
    must have their variables before the first broadcast, or the variable lists differ.
    Stages that depend on the set of workers (`Stage.workers_changed`: AdaSum registers Horovod
    process sets, a collective that must happen at the same point on every worker) are left
    out here: `BoostModelState.sync` builds them.
    """
    if not model.built:
        raise ValueError("The model must be built before its elastic state is made: build it "
                         "(e.g. model.build(input_shape) or one call on a batch) first")
    if getattr(model, "optimizer", None) is None:
        raise ValueError("The model must be compiled before its elastic state is made")
    step = getattr(model, "boost_step", None)
    if step is not None and not step.built:
        step.build(model.boost_state, later=[s.option for s in step.stages if s.overrides("workers_changed")])
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def _broadcast_object(obj):
    if distributed.size() == 1 and not distributed.launched():
        return obj
    return distributed.horovod().broadcast_object(obj, root_rank=0, name="keras_boost.elastic.object")


def _state_base():
    """`horovod.common.elastic.ObjectState` when Horovod can be imported, a minimal stand-in otherwise."""
    if distributed.launched():
        return elastic_support.object_state_class()
    return _LocalObjectState


class _LocalObjectState:
    """ObjectState's contract for a single process without Horovod (nothing to synchronise)."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        del bcast_object, get_rank
        self._saved_state = kwargs
        self._set_attrs()
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        pass

    def save(self):
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        pass

    def reset(self):
        pass

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def BoostModelState(model, **extra):  # noqa: N802 - a class-like factory (the base depends on the launch)
    """The elastic state of a compiled, built `BoostModel` (or any compiled Keras model).

    Like `horovod.tensorflow.elastic.TensorFlowKerasState`, for Keras 3:
        save()     numpy copies of all `model.variables` (the `boost_state` layer's
                   variables included: loss scale, accumulation, freeze position) and all
                   `model.optimizer.variables` (iterations, learning rate, slots), and the
                   Python attributes;
        restore()  writes the last saved copies back (undoes everything since the commit);
        sync()     rank 0's variables (one `hvd.broadcast` per variable) and attributes
                   (`broadcast_object`) to every worker, then save();
        commit()   save() and `check_host_updates()` (raises `HostsUpdatedInterrupt` on
                   every worker at once when workers are about to join or leave);
        reset()    (after a change of workers) drops the compiled train/test/predict
                   functions so Keras retraces them for the new set of workers, and
                   rebuilds the AdaSum stage for the new topology.

    Attributes `epoch`, `batch` (batches done in the epoch), `samples` (samples of the
    epoch done by all workers together) and `history` (per-epoch logs) are always present;
    `**extra` adds your own, synchronised and committed the same way.

    Example:
        >>> state = keras_boost.elastic.BoostModelState(model, best_loss=float("inf"))
        >>> state.register_reset_callbacks([lambda: print("workers:", distributed.size())])
    """
    attributes = {"epoch": 0, "batch": 0, "samples": 0, "history": {}}
    attributes.update(extra)
    cls = _state_class(_state_base())
    return cls(model, **attributes)


_STATE_CLASSES = {}


def _state_class(base):
    if base not in _STATE_CLASSES:
        _STATE_CLASSES[base] = type("BoostModelState", (_BoostModelStateMixin, base),
                                    {"__module__": __name__, "__doc__": BoostModelState.__doc__})
    return _STATE_CLASSES[base]


class _BoostModelStateMixin:
    def __init__(self, model, **attributes):
        distributed.init()
        _build_for_sync(model)
        for stage in _stages(model):
            stage.check_elastic()
        self.model = model
        self.variables = training_variables(model)  # model, boost state, optimizer
        self.resets = 0
        self._save_variables()
        super().__init__(bcast_object=_broadcast_object, get_rank=distributed.rank, **attributes)

    # -------------------------------------------------------------- contract
    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for variable, value in zip(self.variables, self._values):
            variable.assign(value)
        super().restore()

    def sync(self):
        # Collective names must match on every worker; a worker that just joined starts
        # counting from zero, so the survivors do too (their compiled functions are retraced).
        distributed.restart_collective_names()
        _workers_changed(self.model)
        if distributed.size() > 1:
            distributed.broadcast_variables(self.variables, root_rank=0)
        self._save_variables()
        super().sync()

    def reset(self):
        self.resets += 1
        distributed.restart_collective_names()
        model = self.model
        # The compiled functions hold collectives traced for the old workers (their number,
        # the AdaSum groups); Keras retraces them on the next fit/evaluate/predict.
        model.train_function = None
        model.test_function = None
        model.predict_function = None
        _workers_changed(model)  # no sync follows when workers only left
        logger.info("elastic reset %d: %d worker(s), this is rank %d", self.resets, distributed.size(),
                    distributed.rank())

    # --------------------------------------------------------------- helpers
    def _save_variables(self):
        self._values = [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in self.variables]

    def __repr__(self):
        return (f"BoostModelState(epoch={getattr(self, 'epoch', None)}, batch={getattr(self, 'batch', None)}, "
                f"samples={getattr(self, 'samples', None)}, variables={len(self.variables)})")


def _stages(model):
    step = getattr(model, "boost_step", None)
    return list(step.stages) if step is not None else []


def _workers_changed(model):
    """Lets every stage that depends on the set of workers rebuild for the current one (AdaSum's groups)."""
    context = StepContext(model, model.optimizer, list(model.trainable_variables), model.boost_state)
    for stage in _stages(model):
        if stage.overrides("workers_changed"):
            stage.workers_changed(context)


# ------------------------------------------------------------------- run
def _is_horovod_failure(error):
    if isinstance(error, elastic_support.internal_error_class()):
        return True
    if isinstance(error, tf.errors.OpError):
        return any(word in line for line in _failure_lines(error) for word in _HOROVOD_FAILURE_WORDS)
    return False


def _reset_horovod():
    hvd = distributed.horovod()
    hvd.shutdown()
    hvd.init()


def run(func):
    """Runs `func(state, *args, **kwargs)` elastically: the `hvd.elastic.run` of keras_boost.

    Under an elastic launch the call is retried until it returns: when a collective fails
    because a worker died (a TensorFlow error from a Horovod op, or `HorovodInternalError`)
    the state is restored to the last commit; when workers are about to join or leave
    (`HostsUpdatedInterrupt`, raised by `state.commit()`) the committed state is kept. Then
    Horovod is shut down and re-initialised with the new workers, `state.on_reset()` runs
    (Keras' compiled functions are dropped, your reset callbacks run), rank 0's state is
    broadcast (`state.sync()`) and `func` is called again. Differences from
    `horovod.tensorflow.elastic.run`: any Horovod/Gloo op error counts (Horovod's only
    looks for 'HorovodAllreduce'/'HorovodAllgather'/'HorovodBroadcast' and silently
    returns None for other TensorFlow `UnknownError`s); other errors propagate.

    `func` must not run collectives before its first line (new workers run `sync` there).
    Without an elastic launch, `state.sync()` runs once and `func` is called once.

    Example:
        >>> @keras_boost.elastic.run
        ... def train(state):
        ...     model.fit(..., initial_epoch=state.epoch, callbacks=[CommitStateCallback(state, 10)])
        >>> train(state)
    """
    def call_once(state, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)

    if not elastic_launch():
        return call_once

    HorovodInternalError = elastic_support.internal_error_class()  # noqa: N806 - Horovod's class

    def translated(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except HorovodInternalError:
            raise
        except Exception as error:  # noqa: BLE001 - only Horovod failures are translated
            if _is_horovod_failure(error):
                lines = [line for line in _failure_lines(error) if any(w in line for w in _HOROVOD_FAILURE_WORDS)]
                reason = lines[-1][:300] if lines else type(error).__name__
                logger.warning("keras_boost.elastic: a collective failed, restoring the last commit: %s", reason)
                raise HorovodInternalError(error) from error
            raise

    return elastic_support.run_fn(translated, _reset_horovod)


# -------------------------------------------------------------- callback
class CommitStateCallback(keras.callbacks.Callback):
    """Commits the elastic state every `batches_per_commit` batches and at every epoch end.

    Keeps `state.batch` (batches done in the current epoch), `state.samples` (samples of
    the epoch done by all workers together; needs `samples_per_batch`, the global batch)
    and `state.epoch` (epochs done) current, and appends each epoch's logs to
    `state.history`. A commit copies every variable to host memory and runs one small
    broadcast (the host-update check), so commit every few dozen batches, not every one:
    a failure loses the work since the last commit.

    Args:
        state: a `BoostModelState`.
        batches_per_commit: batches between two commits, default 1.
        samples_per_batch: samples one batch of all workers together covers, or None.
    """

    def __init__(self, state, batches_per_commit=1, samples_per_batch=None):
        super().__init__()
        check_int("batches_per_commit", batches_per_commit, 1)
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.samples_per_batch = samples_per_batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch += 1
        if self.samples_per_batch:
            self.state.samples += self.samples_per_batch
        if self.state.batch % self.batches_per_commit == 0:
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        history = getattr(self.state, "history", None)
        if isinstance(history, dict):
            history = {k: list(v) for k, v in history.items()}  # a new object: the saved copy stays intact
            for name, value in (logs or {}).items():
                if np.ndim(value) == 0:
                    history.setdefault(name, []).append(float(value))
            self.state.history = history
        self.state.epoch = epoch + 1
        self.state.batch = 0
        self.state.samples = 0
        self.state.commit()


class _AlreadySynced(BroadcastGlobalVariablesCallback):
    """Stops `BoostModel.fit` from adding its start-of-fit broadcast: `state.sync()` did it."""

    def on_train_begin(self, logs=None):
        pass


# ---------------------------------------------------------------- recipe
def epoch_shard(n, epoch, samples_done, batch_size, rank, size, shuffle=True, seed=0):
    """The row indices this worker trains on in what is left of `epoch`.

    The epoch's order is fixed by (`seed`, `epoch`) (or the identity without `shuffle`),
    so it is the same before and after a change of workers. The `samples_done` first
    samples are skipped; the rest is cut into global batches of `batch_size * size` (an
    incomplete last one is dropped, so every worker runs the same number of steps) and
    worker `rank` takes rows `rank*batch_size:(rank+1)*batch_size` of each: together the
    workers' batches are exactly one batch of `batch_size * size` of one process.
    """
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    rest = order[samples_done:]
    global_batch = batch_size * size
    steps = len(rest) // global_batch
    return rest[:steps * global_batch].reshape(steps, size, batch_size)[:, rank, :].reshape(-1)


def fit_elastic(model, x, y=None, state=None, *, batch_size, epochs, batches_per_commit=10, shuffle=True, seed=0,
                callbacks=None, verbose="auto", **fit_kwargs):
    """Trains `model` on in-memory arrays for `epochs` epochs, surviving workers that die or join.

    Every attempt (the first, and each one after a change of workers) shards the data for
    the current workers with `epoch_shard`, resumes at `state.epoch` and at the
    `state.samples`-th sample of that epoch, and calls `model.fit` one epoch at a time
    (`initial_epoch=state.epoch`) with a `CommitStateCallback`. The per-worker batch size
    stays `batch_size`; the global batch follows the number of workers (scale the learning
    rate in a reset callback if you want it to follow too).

    Args:
        model: a compiled, built `BoostModel`.
        x, y: arrays (or nested structures of arrays) with the same first dimension, the
            same on every worker (each worker takes its own rows).
        state: a `BoostModelState` of `model`; default: a new one.
        batch_size: per-worker batch size.
        epochs: total number of epochs.
        batches_per_commit: batches between two commits (and one at each epoch end).
        shuffle, seed: the per-epoch order (identical on every worker).
        callbacks: more Keras callbacks for each `fit` call (they see one epoch per call).
        verbose, **fit_kwargs: passed to `model.fit` (not `epochs`, `batch_size`,
            `initial_epoch`, `shuffle`, `validation_split`).

    Returns:
        `state.history`: a dict of per-epoch logs ({"loss": [...], ...}), the same on every worker.
    """
    for key in ("epochs", "initial_epoch", "shuffle", "validation_split", "steps_per_epoch"):
        if key in fit_kwargs:
            raise TypeError(f"fit_elastic sets {key} itself")
    check_int("batch_size", batch_size, 1)
    if state is None:
        state = BoostModelState(model)
    n = len(tf.nest.flatten(x)[0])
    callbacks = list(callbacks or [])

    @run
    def train(state):
        while state.epoch < epochs:
            rank, size = distributed.rank(), distributed.size()
            rows = epoch_shard(n, state.epoch, state.samples, batch_size, rank, size, shuffle=shuffle, seed=seed)
            if len(rows) == 0:  # what is left of the epoch is less than one global batch
                state.epoch, state.batch, state.samples = state.epoch + 1, 0, 0
                state.commit()
                continue
            take = (lambda a: a[rows])  # noqa: E731
            xs = tf.nest.map_structure(take, x)
            ys = None if y is None else tf.nest.map_structure(take, y)
            commit = CommitStateCallback(state, batches_per_commit, samples_per_batch=batch_size * size)
            model.fit(xs, ys, batch_size=batch_size, epochs=state.epoch + 1, initial_epoch=state.epoch,
                      shuffle=False, verbose=verbose, callbacks=[_AlreadySynced(), *callbacks, commit],
                      **fit_kwargs)
        return state.history

    return train(state)


__all__ = ["BoostModelState", "CommitStateCallback", "elastic_launch", "epoch_shard", "fit_elastic", "run"]
