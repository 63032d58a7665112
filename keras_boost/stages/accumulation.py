"""Gradient accumulation that communicates once per update.

Micro-batch gradients (already unscaled when loss scaling is on) are summed locally into
one accumulator per trainable variable; at the window boundary their mean is handed to
the rest of the step, which allreduces it once and applies the optimizer once. So the
optimizer's `iterations` and any learning-rate schedule advance once per update.

An incomplete window carries over: the accumulators and the micro-step counter are
variables, so the window simply continues in the next epoch (or the next `fit`, or after
a restore). BatchNorm moving statistics update on every micro-batch, as in Keras and
MindSpore, since they are updated by the forward pass.
"""

import numbers

import keras
import tensorflow as tf

from keras_boost import _keras_compat
from keras_boost._validation import check_int, positive_int_arg
from keras_boost.core.contract import Stage, StepContext, Window
from keras_boost.core.state import BoostState


class GradientAccumulation(Stage):
    """Accumulates `max_accumulation_step` micro-batch gradients per optimizer update.

    MindSpore's `GradientAccumulation(max_accumulation_step, optimizer)`: the applied
    gradient is the mean of the micro-batch gradients, each of them averaged over its
    micro-batch, so N micro-batches of b samples update the model as one batch of N·b.

    Args:
        max_accumulation_step: micro-batches per update, a positive integer (1 turns
            accumulation off).
        optimizer: the Keras optimizer the accumulated gradient is applied with. None when
            the stage is given to a boost step, which uses its own optimizer; when given
            there it must be that optimizer (checked when the step is built). Needed for
            the callable form.

    Called, as MindSpore's cell `construct(loss, grads)`: `accumulation(loss, grads)` adds
    `grads` (one per variable the optimizer was built on, in that order, or per
    `variables=` given to the call), and every `max_accumulation_step` calls applies their
    mean with `optimizer` and starts a new window; it returns `loss`. It works eagerly and
    inside `tf.function`; the state (accumulators, counter) is created on the first call.

    Example:
        >>> model.compile(optimizer="sgd", loss="mse",
        ...               gradient_accumulation=keras_boost.GradientAccumulation(4))
        >>> accumulation = keras_boost.GradientAccumulation(4, optimizer)  # MindSpore's form
        >>> loss = accumulation(loss, tape.gradient(loss, model.trainable_variables))

    Example:
        >>> model.compile(optimizer="sgd", loss="mse",
        ...               gradient_accumulation=keras_boost.GradientAccumulation(4))
    """

    option = "gradient_accumulation"
    option_help = 'micro-batches per update (int), a `GradientAccumulation`, or False.'
    option_values = "None, False, a positive int (micro-batches per update)"

    def __init__(self, max_accumulation_step, optimizer=None):
        max_accumulation_step = check_int("max_accumulation_step", max_accumulation_step, 1)
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a keras.optimizers.Optimizer or None, got {type(optimizer).__name__}")
        self.max_accumulation_step = int(max_accumulation_step)
        self.optimizer = optimizer
        self.accumulators = []
        self.micro_step = None

    @classmethod
    def add_cli_arguments(cls, groups):
        groups["training"].add_argument("--accumulation", type=positive_int_arg, default=1, help="micro-batches per update")

    @classmethod
    def option_from_cli(cls, args):
        return args.accumulation if getattr(args, "accumulation", 1) > 1 else None

    @classmethod
    def batches_per_update(cls, value):
        return getattr(value, "max_accumulation_step", value) or 1

    @classmethod
    def from_option(cls, value, model):
        """None or False (off; False also switches off a boost level's accumulation), an int number
        of micro-batches per update, or a `GradientAccumulation` (1 means off)."""
        if value is None or value is False:
            return None
        if not isinstance(value, GradientAccumulation):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise cls.bad_option(value)
            if value < 1:
                raise cls.bad_option(value, ValueError)
        stage = value if isinstance(value, GradientAccumulation) else cls(value)
        return None if stage.max_accumulation_step == 1 else stage

    def build(self, context):
        """Creates the accumulators (one per trainable variable) and the micro-step counter."""
        state, variables = context.state, context.variables
        step_optimizer = getattr(context, "optimizer", None)
        if self.optimizer is not None and step_optimizer is not None and step_optimizer is not self.optimizer:
            # The step applies the window with its own optimizer; another one here would be ignored.
            raise ValueError(
                "The optimizer of `gradient_accumulation` (a GradientAccumulation) must be the optimizer the step "
                f"trains with: got {type(self.optimizer).__name__} {self.optimizer.name!r}, but the step uses "
                f"{type(step_optimizer).__name__} {step_optimizer.name!r}. Pass the same instance, or none.")
        self.variables = list(variables)
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

    def window(self, grads, indices):
        boundary = self.accumulate(grads, indices)
        return Window(boundary, lambda: self.mean(indices), lambda: self.reset(indices))

    def steps_to_boundary(self):
        """(micro-batches left in this window, micro-batches per window), read between steps."""
        return self.max_accumulation_step - int(self.micro_step.numpy()), self.max_accumulation_step

    def mean(self, indices):
        """The mean gradient of the window for the variables at `indices`."""
        inverse = 1.0 / tf.cast(self.micro_step.value, tf.float32)
        return [self.accumulators[index].value * inverse for index in indices]

    def reset(self, indices):
        for index in indices:
            acc = self.accumulators[index]
            acc.assign(tf.zeros_like(acc.value))
        self.micro_step.assign(0)

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """The configuration's `grad_accumulation_step`."""
        steps = boost_config.params["grad_accumulation"]["grad_accumulation_step"]
        if validate:
            return cls(steps)
        return steps if boost_config.features["grad_accumulation"] else None

    def get_config(self):
        return {"max_accumulation_step": self.max_accumulation_step}

    def __call__(self, loss, grads, variables=None):
        """MindSpore's `construct(loss, grads)`: accumulate, apply the mean at the boundary; returns `loss`."""
        if self.optimizer is None:
            raise ValueError("GradientAccumulation called as a cell needs its optimizer: "
                             "GradientAccumulation(max_accumulation_step, optimizer)")
        if self.micro_step is None:
            if variables is None:
                variables = _keras_compat.optimizer_variables(self.optimizer)
            if variables is None:
                raise ValueError("GradientAccumulation called as a cell needs the variables the gradients belong "
                                 "to: build the optimizer first (optimizer.build(model.trainable_variables)) or "
                                 "pass variables=")
            with tf.init_scope():
                if not self.optimizer.built:
                    self.optimizer.build(list(variables))
                self.state = BoostState(name="gradient_accumulation_state")
                self.build(StepContext(None, self.optimizer, list(variables), self.state))
        grads = list(grads)
        if len(grads) != len(self.variables):
            raise ValueError(f"`grads` must hold one gradient per variable ({len(self.variables)}), got {len(grads)}")
        indices = [i for i, g in enumerate(grads) if g is not None]
        boundary = self.accumulate([grads[i] for i in indices], indices)

        def apply():
            self.optimizer.apply(self.mean(indices), [self.variables[i] for i in indices])
            self.reset(indices)
            return tf.constant(True)

        tf.cond(boundary, apply, lambda: tf.constant(False))
        return loss
