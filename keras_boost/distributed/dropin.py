"""What makes `BoostModel` a drop-in for `keras.Model` in ordinary Keras code.

- A distributed optimizer: the compiled optimizer's `apply` (and so `apply_gradients`)
  averages the gradients across workers when a user's own `train_step` calls it, as
  Horovod's `DistributedOptimizer` does; the boost step, which averages by itself, passes
  through.
- No XLA around collectives: Horovod's ops have no XLA kernels, so the train function of
  a multi-worker run is compiled without XLA (one warning); evaluate and predict keep it.
- Rank-0-only evaluate: in the Horovod idiom `if rank == 0: model.evaluate(...)` at the
  end of a script the other workers exit and Horovod shuts down; the metric average then
  falls back to rank 0's own results (one warning) instead of ending the job. predict and
  save run no collective at all.
- Logs: one line per epoch under a launcher whose output is not a terminal, and the
  boost scalars are kept out of the progress bar (they stay in the logs, the History
  and TensorBoard).
"""

import contextlib
import logging
import os
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_boost import distributed

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
            warnings.warn(
                f"jit_compile is on, but on {distributed.size()} workers the train step runs Horovod "
                "collectives, which XLA cannot compile: the train step runs without XLA (evaluate and "
                "predict keep it). compile(jit_compile=False) silences this warning.",
                stacklevel=4,
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
        warnings.warn("the other workers have finished (Horovod is shut down): these metrics are this "
                      f"worker's own (rank {distributed.rank()}), not averaged", stacklevel=3)
    return {n: float(np.asarray(keras.ops.convert_to_numpy(v))) if np.ndim(v) == 0 else v
            for n, v in results.items()}


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
    hidden = set(step.logs()) if step is not None and step.built else set()
    hidden |= _BOOST_LOG_KEYS
    callbacks = list(callbacks or [])
    if verbose == 0 or any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        return callbacks, verbose
    callbacks.append(BoostProgbarLogger(verbose, hidden))
    return callbacks, 0


# Boost scalars a step may log (loss scaling, freezing); hidden from the bar even before the
# step is built.
_BOOST_LOG_KEYS = {"loss_scale", "overflow", "freeze_group"}


def quiet_tensorflow():
    """Keeps TensorFlow's C++ start-up lines out of the CLI's output (unless the user set the level)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
