"""Loss scaling for mixed precision: the scale-loss / unscale / overflow / update stage.

The seed's `scale_sense` is either a loss-scale "Cell" (here: `DynamicLossScale` or
`FixedLossScale`) or a scalar tensor holding a fixed scale that the host may change.
`as_loss_scale` turns any accepted form into a stage; everything else is refused when the
step is made, never in the middle of training.

A stage's state (the scale, its counters and the last overflow flag) lives in variables
created by `build(state)`, so checkpoints and `.keras` files carry it.
"""

import math
import numbers

import numpy as np
import tensorflow as tf

DEFAULT_INIT_SCALE = 2.0**15


def _check_number(name, value, *, low=None, low_inclusive=False, integer=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "an integer" if integer else "a number"
        raise TypeError(f"{name} must be {kind}, got {value!r} of type {type(value).__name__}")
    if integer and not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        bound = ">=" if low_inclusive else ">"
        raise ValueError(f"{name} must be {bound} {low}, got {value!r}")
    return value


class LossScale:
    """Base of the loss-scale stages: scale the loss, unscale gradients, decide, update."""

    drop_overflow_update = True

    def __init__(self):
        self.scale = None
        self.last_overflow = None
        self.overflow_count = None

    def build(self, state):
        """Creates this stage's variables in `state` (a `BoostState` layer)."""
        self.last_overflow = state.add_state("loss_scale/last_overflow", 0, "int32")
        self.overflow_count = state.add_state("loss_scale/overflow_count", 0, "int64")

    def scale_loss(self, loss):
        return loss * tf.cast(self.scale, loss.dtype)

    def unscale(self, grads):
        inverse = 1.0 / tf.convert_to_tensor(self.scale)
        return [None if g is None else g * tf.cast(inverse, g.dtype) for g in grads]

    def update(self, finite):
        """Records the (already global) finiteness of this update; returns whether to skip it."""
        overflow = tf.logical_not(finite)
        self.last_overflow.assign(tf.cast(overflow, tf.int32))
        self.overflow_count.assign_add(tf.cast(overflow, tf.int64))
        self._adapt(finite)
        return tf.logical_and(overflow, self.drop_overflow_update)

    def _adapt(self, finite):
        return None

    def logs(self):
        return {"overflow": self.last_overflow.value, "loss_scale": tf.reshape(tf.convert_to_tensor(self.scale), [])}


class DynamicLossScale(LossScale):
    """A loss scale that halves on overflow and grows after a run of clean updates.

    On an overflow the scale is divided by `scale_factor` once `hysteresis` consecutive
    overflows have been seen, never below `min_scale`; after `scale_window` consecutive
    clean updates it is multiplied by `scale_factor`, never above `max_scale`. The update
    of an overflowing step is always skipped. With `hysteresis=1`, `min_scale` low enough
    and no `max_scale`, its decisions are those of Keras' `LossScaleOptimizer` with the
    same initial scale and `dynamic_growth_steps=scale_window`.

    Args:
        init_scale: initial scale, default `2**15` (Keras' default; float16 overflows at
            65504, so a larger start only costs a few skipped steps).
        scale_factor: factor to divide by on overflow and multiply by on growth, > 1. Default 2.
        scale_window: clean updates before the scale grows, integer >= 1. Default 2000.
        min_scale: floor of the scale, > 0. Default 1.
        max_scale: ceiling of the scale, or None for none. Default None.
        hysteresis: consecutive overflows needed before the scale drops, integer >= 1.
            Default 1.

    Example:
        >>> scale = keras_boost.DynamicLossScale(init_scale=2**12, scale_window=500)
    """

    def __init__(self, init_scale=DEFAULT_INIT_SCALE, scale_factor=2, scale_window=2000,
                 min_scale=1, max_scale=None, hysteresis=1):
        super().__init__()
        self.init_scale = float(_check_number("init_scale", init_scale, low=0))
        self.scale_factor = float(_check_number("scale_factor", scale_factor, low=1))
        self.scale_window = int(_check_number("scale_window", scale_window, low=1, low_inclusive=True, integer=True))
        self.min_scale = float(_check_number("min_scale", min_scale, low=0))
        if max_scale is not None:
            max_scale = float(_check_number("max_scale", max_scale, low=0))
            if max_scale < self.min_scale:
                raise ValueError(f"max_scale ({max_scale}) must be >= min_scale ({self.min_scale})")
        self.max_scale = max_scale
        self.hysteresis = int(_check_number("hysteresis", hysteresis, low=1, low_inclusive=True, integer=True))
        if not self.min_scale <= self.init_scale <= (max_scale or math.inf):
            raise ValueError(
                f"init_scale ({self.init_scale}) must lie in [min_scale, max_scale] = "
                f"[{self.min_scale}, {max_scale}]"
            )

    def build(self, state):
        super().build(state)
        self.scale = state.add_state("loss_scale/scale", self.init_scale, "float32")
        self.clean_steps = state.add_state("loss_scale/clean_steps", 0, "int64")
        self.overflow_streak = state.add_state("loss_scale/overflow_streak", 0, "int64")

    def _adapt(self, finite):
        factor = tf.constant(self.scale_factor, tf.float32)
        ceiling = tf.constant(self.max_scale or np.finfo(np.float32).max, tf.float32)
        streak = tf.where(finite, tf.zeros_like(self.overflow_streak), self.overflow_streak + 1)
        drop = streak >= self.hysteresis
        clean = tf.where(finite, self.clean_steps + 1, tf.zeros_like(self.clean_steps))
        grow = clean >= self.scale_window
        scale = self.scale.value
        scale = tf.where(drop, tf.maximum(scale / factor, self.min_scale), scale)
        scale = tf.where(grow, tf.minimum(scale * factor, ceiling), scale)
        self.scale.assign(scale)
        self.overflow_streak.assign(tf.where(drop, tf.zeros_like(streak), streak))
        self.clean_steps.assign(tf.where(grow, tf.zeros_like(clean), clean))

    def get_config(self):
        return {
            "init_scale": self.init_scale, "scale_factor": self.scale_factor,
            "scale_window": self.scale_window, "min_scale": self.min_scale,
            "max_scale": self.max_scale, "hysteresis": self.hysteresis,
        }


class FixedLossScale(LossScale):
    """A constant loss scale; the seed's `FixedLossScaleManager`.

    Args:
        value: the scale, > 0. It lives in a variable: `step.set_sense_scale(v)` or
            assigning the variable changes it between steps.
        drop_overflow_update: skip the update when a gradient is not finite (default True).
            With False the update is applied anyway, as in the seed.

    Example:
        >>> scale = keras_boost.FixedLossScale(1024.0)
    """

    def __init__(self, value, drop_overflow_update=True):
        super().__init__()
        self.value = float(_check_number("value", value, low=0))
        if not isinstance(drop_overflow_update, bool):
            raise TypeError(f"drop_overflow_update must be a bool, got {drop_overflow_update!r}")
        self.drop_overflow_update = drop_overflow_update
        self._variable = None

    def build(self, state):
        super().build(state)
        self.scale = self._variable or state.add_state("loss_scale/scale", self.value, "float32")

    def get_config(self):
        return {"value": self.value, "drop_overflow_update": self.drop_overflow_update}


def _tensor_scale(scale_sense, name):
    shape = tuple(scale_sense.shape)
    if shape not in ((), (1,)):
        raise ValueError(f"The shape of {name} must be (1,) or (), but got {shape}")
    value = float(np.asarray(scale_sense).reshape(()))
    stage = FixedLossScale(_check_number(name, value, low=0))
    if hasattr(scale_sense, "assign") and shape == ():
        stage._variable = scale_sense  # the host keeps changing the user's own variable
    return stage


def as_loss_scale(scale_sense, name="scale_sense"):
    """Turns the seed's `scale_sense` (a LossScale, or a () / (1,) tensor) into a stage."""
    if isinstance(scale_sense, LossScale):
        return scale_sense
    if isinstance(scale_sense, (tf.Tensor, tf.Variable, np.ndarray)) or hasattr(scale_sense, "value") and hasattr(
        scale_sense, "shape"
    ):
        return _tensor_scale(scale_sense, name)
    raise TypeError(
        f"The {name} must be a DynamicLossScale / FixedLossScale or a Tensor of shape () or (1,), "
        f"but got {type(scale_sense).__name__}: {scale_sense!r}"
    )


def all_finite(grads):
    """True when every entry of every gradient is finite."""
    checks = [tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
