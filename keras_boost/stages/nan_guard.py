"""The NaN guard (`compile(nan_guard=True)`): without loss scaling, never write a non-finite update.

MindSpore and Keras apply whatever gradient they get unless a loss scale is on, and so
does the boost step by default. With the guard, keras_boost keeps a non-finite averaged
gradient out of the weights (the decision is the same on every worker, because the
averaged gradients are) and counts it; `BoostModel.fit` then stops with
`FloatingPointError` at that batch. Off by default: every update waits for the check of all
gradients (its cost: docs/benchmarks.md). With a loss scale, the loss scale makes this
decision instead.
"""

import tensorflow as tf

from keras_boost._validation import check_bool
from keras_boost.core.contract import Stage


class NanGuard(Stage):
    """Skips (and counts) updates whose averaged gradient is not finite (optax's `apply_if_finite`)."""

    option = "nan_guard"
    step_attribute = "nan_guard"
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

    def should_skip(self, finite):
        skip = tf.logical_not(finite)
        self.nonfinite_updates.assign_add(tf.cast(skip, tf.int64))
        return skip
