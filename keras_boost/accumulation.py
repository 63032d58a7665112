"""Gradient accumulation that communicates once per update.

Micro-batch gradients (already unscaled when loss scaling is on) are summed locally into
one accumulator per trainable variable; at the window boundary their mean is handed to
the rest of the step, which allreduces it once and applies the optimizer once. So the
optimizer's `iterations` and any learning-rate schedule advance once per update.

An incomplete window carries over: the accumulators and the micro-step counter are
variables, so the window simply continues in the next epoch (or the next `fit`, or after
a restore). BatchNorm moving statistics update on every micro-batch, as in Keras and the
seed, since they are updated by the forward pass.
"""

import numbers

import keras
import tensorflow as tf


class GradientAccumulation:
    """Accumulates `max_accumulation_step` micro-batch gradients per optimizer update.

    The seed's `GradientAccumulation(max_accumulation_step, optimizer)`: the applied
    gradient is the mean of the micro-batch gradients, each of them averaged over its
    micro-batch, so N micro-batches of b samples update the model as one batch of N·b.

    Args:
        max_accumulation_step: micro-batches per update, a positive integer (1 turns
            accumulation off).
        optimizer: the Keras optimizer the accumulated gradient is applied with, or None
            when the stage is given to a BoostModel (which uses its compiled optimizer).

    Example:
        >>> model.compile(optimizer="sgd", loss="mse",
        ...               gradient_accumulation=keras_boost.GradientAccumulation(4))
    """

    def __init__(self, max_accumulation_step, optimizer=None):
        if isinstance(max_accumulation_step, bool) or not isinstance(max_accumulation_step, numbers.Integral):
            raise TypeError(
                "max_accumulation_step must be a positive integer, got "
                f"{max_accumulation_step!r} of type {type(max_accumulation_step).__name__}"
            )
        if max_accumulation_step < 1:
            raise ValueError(f"max_accumulation_step must be a positive integer, got {max_accumulation_step}")
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a keras.optimizers.Optimizer or None, got {type(optimizer).__name__}")
        self.max_accumulation_step = int(max_accumulation_step)
        self.optimizer = optimizer
        self.accumulators = []
        self.micro_step = None

    def build(self, state, variables):
        """Creates the accumulators (one per trainable variable) and the micro-step counter."""
        self.micro_step = state.add_state("accumulation/micro_step", 0, "int64")
        self.accumulators = [
            state.add_state(f"accumulation/{index}", 0.0, "float32", shape=tuple(v.shape))
            for index, v in enumerate(variables)
        ]

    def accumulate(self, grads, indices):
        """Adds the micro-batch gradients of the variables at `indices`; returns True at a boundary."""
        for grad, index in zip(grads, indices):
            if grad is not None:
                self.accumulators[index].assign_add(tf.cast(grad, tf.float32))
        self.micro_step.assign_add(1)
        return self.micro_step.value >= self.max_accumulation_step

    def mean(self, indices):
        """The mean gradient of the window for the variables at `indices`."""
        inverse = 1.0 / tf.cast(self.micro_step.value, tf.float32)
        return [self.accumulators[index].value * inverse for index in indices]

    def reset(self, indices):
        for index in indices:
            acc = self.accumulators[index]
            acc.assign(tf.zeros_like(acc.value))
        self.micro_step.assign(0)

    def get_config(self):
        return {"max_accumulation_step": self.max_accumulation_step}
