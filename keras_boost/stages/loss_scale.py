"""Loss scaling for mixed precision: the scale-loss / unscale / overflow / update stage.

MindSpore's `scale_sense` is either a loss-scale "Cell" (here: `DynamicLossScale` or
`FixedLossScale`) or a scalar tensor holding a fixed scale that the host may change.
`as_loss_scale` turns any accepted form into a stage; everything else is refused when the
step is made, never in the middle of training.

A stage's state (the scale, its counters and the last overflow flag) lives in variables
created by `build(context)` in the step's `BoostState`, so checkpoints and `.keras` files
carry it.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from keras_boost._validation import alias, check_bool, check_int, check_real
from keras_boost.core.adapter import keras_loss_scale_optimizer
from keras_boost.core.contract import Stage, map_values

DEFAULT_INIT_SCALE = 2.0**15


class LossScale(Stage):
    """Base of the loss-scale stages: scale the loss, unscale gradients, decide, update.

    Hooks: `scale_loss`, `local_gradients` (unscale, before accumulation), `should_skip`
    (record the overflow, adapt the scale, skip the update), `logs`.
    """

    option = "loss_scale"
    option_help = ('None or "auto" (dynamic scaling under the `mixed_float16` policy, none otherwise), False (none),'
                   ' "dynamic", a number or scalar tensor (fixed), or a `DynamicLossScale` / `FixedLossScale`.')
    option_values = "None, 'auto', False, 'dynamic', a positive number, a scalar tensor"
    needs_finite = True
    drop_overflow_update = True

    def __init__(self):
        self.scale = None
        self.last_overflow = None
        self.overflow_count = None

    @classmethod
    def add_cli_arguments(cls, groups):
        groups["training"].add_argument("--loss-scale", choices=["none", "dynamic"], default="none")

    @classmethod
    def option_from_cli(cls, args):
        return "dynamic" if getattr(args, "loss_scale", "none") == "dynamic" else None

    @classmethod
    def from_option(cls, value, model):
        """`compile(loss_scale=...)`: None/"auto", False (none, even under mixed_float16), "dynamic",
        a number, a scalar tensor or a LossScale."""
        if value is False:
            return None
        if value is None or (isinstance(value, str) and value == "auto"):
            policy = keras.config.dtype_policy().name
            if keras_loss_scale_optimizer(getattr(model, "optimizer", None)) is not None:
                return None  # the user's LossScaleOptimizer scales the loss, as in keras.Model
            return DynamicLossScale() if policy == "mixed_float16" else None
        if isinstance(value, str):
            if value == "dynamic":
                return DynamicLossScale()
            raise cls.bad_option(value, ValueError)
        if isinstance(value, LossScale):
            return value
        if isinstance(value, bool):  # True: which scale? 'dynamic' says it
            raise cls.bad_option(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return as_loss_scale(tf.constant(float(value)), name="loss_scale")
        if not (tf.is_tensor(value) or isinstance(value, (np.ndarray, np.number))):
            raise cls.bad_option(value)
        return as_loss_scale(value, name="loss_scale")

    def check_optimizer(self, optimizer):
        if keras_loss_scale_optimizer(optimizer) is not None:
            raise ValueError(
                f"`loss_scale` is given (a {type(self).__name__}) and the optimizer is a "
                "keras.optimizers.LossScaleOptimizer: two loss scales would scale the same loss. Pass the optimizer it wraps (`inner_optimizer`) with "
                "compile(loss_scale=...) for keras_boost's loss scale (one overflow decision for all workers), or "
                "leave `loss_scale` out to keep the LossScaleOptimizer's.")

    def build(self, context):
        """Creates this stage's variables in the step's `BoostState`."""
        state = context.state
        self.last_overflow = state.add_state("loss_scale/last_overflow", 0, "int32")
        self.overflow_count = state.add_state("loss_scale/overflow_count", 0, "int64")

    def scale_loss(self, loss):
        return loss * tf.cast(self.scale, loss.dtype)

    def unscale(self, grads):
        inverse = 1.0 / tf.convert_to_tensor(self.scale)
        return [None if g is None else map_values(lambda v: v * tf.cast(inverse, v.dtype), g) for g in grads]

    def local_gradients(self, grads, indices):
        return self.unscale(grads)

    def should_skip(self, finite):
        return self.update(finite)

    def update(self, finite):
        """Records the (already global) finiteness of this update; returns whether to skip it."""
        overflow = tf.logical_not(finite)
        self.last_overflow.assign(tf.cast(overflow, tf.int32))
        self.overflow_count.assign_add(tf.cast(overflow, tf.int64))
        self._adapt(finite)
        return tf.logical_and(overflow, self.drop_overflow_update)

    def _adapt(self, finite):
        return None

    log_keys = ("overflow", "loss_scale")

    def report(self, step):
        return {"overflows": int(self.overflow_count.numpy())} if self.overflow_count is not None else {}

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
        loss_scale_value: MindSpore's name of `init_scale` (`DynamicLossScaleUpdateCell`),
            accepted as an alias.

    Example:
        >>> scale = keras_boost.DynamicLossScale(init_scale=2**12, scale_window=500)
    """

    def __init__(self, init_scale=DEFAULT_INIT_SCALE, scale_factor=2, scale_window=2000,
                 min_scale=1, max_scale=None, hysteresis=1, *, loss_scale_value=None):
        super().__init__()
        if loss_scale_value is not None:  # MindSpore's DynamicLossScaleUpdateCell keyword
            init_scale = alias("init_scale", None if init_scale == DEFAULT_INIT_SCALE else init_scale,
                               "loss_scale_value", loss_scale_value)
        self.init_scale = check_real("init_scale", init_scale, low=0, low_inclusive=False)
        self.scale_factor = check_real("scale_factor", scale_factor, low=1, low_inclusive=False)
        self.scale_window = check_int("scale_window", scale_window, 1)
        self.min_scale = check_real("min_scale", min_scale, low=0, low_inclusive=False)
        if max_scale is not None:
            max_scale = check_real("max_scale", max_scale, low=0, low_inclusive=False)
            if max_scale < self.min_scale:
                raise ValueError(f"max_scale ({max_scale}) must be >= min_scale ({self.min_scale})")
        self.max_scale = max_scale
        self.hysteresis = check_int("hysteresis", hysteresis, 1)
        if not self.min_scale <= self.init_scale <= (max_scale or math.inf):
            raise ValueError(
                f"init_scale ({self.init_scale}) must lie in [min_scale, max_scale] = "
                f"[{self.min_scale}, {max_scale}]"
            )

    def build(self, context):
        super().build(context)
        state = context.state
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
    """A constant loss scale; MindSpore's `FixedLossScaleManager`.

    Args:
        value: the scale, > 0. It lives in a variable: `step.set_sense_scale(v)` or
            assigning the variable changes it between steps.
        drop_overflow_update: skip the update when a gradient is not finite (default True).
            With False the update is applied anyway, as in MindSpore.

    Example:
        >>> scale = keras_boost.FixedLossScale(1024.0)
    """

    def __init__(self, value, drop_overflow_update=True):
        super().__init__()
        self.value = check_real("value", value, low=0, low_inclusive=False)
        self.drop_overflow_update = check_bool("drop_overflow_update", drop_overflow_update)
        self._variable = None

    def build(self, context):
        super().build(context)
        state = context.state
        self.scale = self._variable or state.add_state("loss_scale/scale", self.value, "float32")

    def get_config(self):
        return {"value": self.value, "drop_overflow_update": self.drop_overflow_update}


def _tensor_scale(scale_sense, name):
    shape = tuple(scale_sense.shape)
    if shape not in ((), (1,)):
        raise ValueError(f"The shape of {name} must be (1,) or (), but got {shape}")
    value = float(np.asarray(scale_sense).reshape(()))
    stage = FixedLossScale(check_real(name, value, low=0, low_inclusive=False))
    if hasattr(scale_sense, "assign") and shape == ():
        stage._variable = scale_sense  # the host keeps changing the user's own variable
    return stage


def as_loss_scale(scale_sense, name="scale_sense"):
    """Turns MindSpore's `scale_sense` (a LossScale, or a () / (1,) tensor) into a stage."""
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

