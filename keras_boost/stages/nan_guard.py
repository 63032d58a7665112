"""The NaN guard (`compile(nan_guard=True)`): without loss scaling, never write a non-finite update.

MindSpore and Keras apply whatever gradient they get unless a loss scale is on, and so
does the boost step by default. With the guard, keras_boost keeps a non-finite averaged
gradient out of the weights (the decision is the same on every worker, because the
averaged gradients are) and counts it; `BoostModel.fit` then stops with
`FloatingPointError` at that batch. Off by default: every update waits for the check of all
gradients (its cost: docs/benchmarks.md). With a loss scale, the loss scale makes this
decision instead.
"""

import keras
import tensorflow as tf

from keras_boost import distributed
from keras_boost._validation import check_bool
from keras_boost.core.contract import Stage


class NanGuard(Stage):
    """Skips (and counts) updates whose averaged gradient is not finite (optax's `apply_if_finite`)."""

    option = "nan_guard"
    option_help = ('True: without loss scaling, stop `fit` with `FloatingPointError` at the first update whose '
                   'averaged gradient is not finite, before it reaches the weights (every update then waits for a '
                   'check of all gradients). Default False: the update is applied, as keras.Model does.')
    needs_finite = True

    def __init__(self):
        self.nonfinite_updates = None

    @classmethod
    def from_option(cls, value, model):
        if value is None:
            return None
        if isinstance(value, NanGuard):
            return value
        return cls() if check_bool("nan_guard", value) else None

    def build(self, context):
        self.nonfinite_updates = context.state.add_state("guard/nonfinite_updates", 0, "int64")

    def fit_callbacks(self):
        return [NonFiniteGuard(self)]

    def should_skip(self, finite):
        skip = tf.logical_not(finite)
        self.nonfinite_updates.assign_add(tf.cast(skip, tf.int64))
        return skip


class NonFiniteGuard(keras.callbacks.Callback):
    """Stops `fit` when the boost step refused a non-finite update (BoostModel adds it itself).

    The step has already kept the non-finite gradient out of the weights; every worker
    takes the same decision, so every worker stops at the same batch.
    """

    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def on_train_begin(self, logs=None):
        self._seen = self._count()

    def _count(self):
        counter = self.guard.nonfinite_updates
        return 0 if counter is None else int(counter.numpy())

    def on_train_batch_end(self, batch, logs=None):
        count = self._count()
        if count > self._seen:
            raise FloatingPointError(
                f"non-finite gradient at batch {batch} (rank {distributed.rank()} of {distributed.size()}): the "
                "update was not applied and training stopped. Lower the learning rate, check the data, or use "
                "loss_scale=... to skip such steps and go on; compile(nan_guard=False) applies them like plain Keras."
            )
