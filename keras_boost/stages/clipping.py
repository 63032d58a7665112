"""Gradient clipping by global norm, on the averaged gradients.

`BoostModel.compile(gradient_clipping=1.0)` rescales each update's gradients so that their
global L2 norm is at most 1.0, as `keras.optimizers.SGD(..., global_clipnorm=1.0)` does.
It runs at the `transform` hook: after the gradients are averaged across workers (every
worker clips the same gradients the same way) and unscaled, after the overflow decision,
and after gradient centralization. MindSpore's boost has no such option; Keras' optimizer
argument `global_clipnorm` clips the same way inside `optimizer.apply`.

With gradient freezing, the norm is that of the gradients the step trains (its group).
"""

import numbers

import tensorflow as tf

from keras_boost.core.contract import Stage


class GradientClipping(Stage):
    """Clips the step's gradients to a global L2 norm of at most `clip_norm`.

    Args:
        clip_norm: a finite number > 0.
    """

    option = "gradient_clipping"
    option_help = ('a clip norm (positive number: the averaged gradients clipped to that global norm) or a '
                   '`GradientClipping`.')
    _optimizer = None  # the step's optimizer, once built (`transform` allows for its loss scale)

    def __init__(self, clip_norm):
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, numbers.Real) or not (
                0 < clip_norm < float("inf")):
            raise ValueError(f"`gradient_clipping` must be a finite number > 0 (the largest global norm of the "
                             f"gradients), got {clip_norm!r} ({type(clip_norm).__name__}).")
        self.clip_norm = float(clip_norm)

    @classmethod
    def from_option(cls, value, model):
        if value is None or value is False:
            return None
        return value if isinstance(value, cls) else cls(value)

    def build(self, context):
        self._optimizer = context.optimizer

    def transform(self, grads, variables):
        # The optimizer's own loss scale (Keras' LossScaleOptimizer, `loss_scale_factor`) is
        # still in the gradients here (its `apply` divides it out): the norm is clipped at
        # `clip_norm` times that scale, which clips the unscaled gradients at `clip_norm`.
        limit = self.clip_norm if self._optimizer is None else self._optimizer.scale_loss(self.clip_norm)
        return tf.clip_by_global_norm(grads, limit)[0]

    def get_config(self):
        return {"clip_norm": self.clip_norm}
