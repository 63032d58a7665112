"""MindSpore's callable step: `BoostTrainOneStep(...)(x, y)` with its `*_process` methods.

MindSpore's boost pieces are cells that users call. Here each is the one implementation
(the boost step `keras_boost.step.loop.BoostStep`, the loop that `BoostModel.fit` runs,
and its stages) plus what the cell adds: building itself on the first call and MindSpore's
calling form. `BoostTrainOneStep` adds `gradient_accumulation_process`, `adasum_process`,
`gradient_freeze_process` and `check_adasum_enable`. The accumulation and AdaSum cells are
their stages themselves (`keras_boost.stages.accumulation.GradientAccumulation` and
`keras_boost.stages.adasum.AdaSum`, each with MindSpore's `__call__`): the same objects are
given to `BoostModel.compile`.
"""

import functools
import numbers

import keras
import numpy as np
import tensorflow as tf

from keras_boost import distributed
from keras_boost.core.state import BoostState, training_variables
from keras_boost.stages.loss_scale import as_loss_scale
from keras_boost.step.loop import BoostStep


class BoostTrainOneStep(BoostStep):
    """Runs one boost training step of `model` with `optimizer` (MindSpore's BoostTrainOneStepCell).

    Args:
        model: the Keras model being trained (usually a `BoostModel`, which owns the step).
        optimizer: a built or unbuilt `keras.optimizers.Optimizer`.
        sens: scale of the loss gradient, default 1.0. As in MindSpore the gradients stay
            multiplied by it (with plain SGD it scales the learning rate); use a loss-scale
            stage for mixed precision instead.
        loss_scale, gradient_accumulation, gradient_freeze, gradient_centralization,
        adasum, nan_guard: the options of `BoostModel.compile`, turned into stages by the
            registry (`keras_boost.step.registry`); a ready stage object is accepted too.
        gradient_split_groups: increasing variable indices at which a new fused
            allreduce starts, or None: each gradient goes to Horovod as soon as the
            backward pass produces it, and Horovod's tensor fusion packs them.
        stages: more `Stage` objects to run (after the registry's), e.g. your own.
        loss_fn: the loss of a standalone step, `loss_fn(y, y_pred[, sample_weight])`
            (MindSpore's `WithLossCell(network, loss_fn)`); default: the loss the model
            was compiled with. Regularization losses of the model are added.
        **options: options of stages registered with `registry.register`.

    A `FreezeOpt` optimizer is unwrapped: its optimizer applies the updates and its groups
    and sequence become the freeze stage (as `gradient_freeze=FreezeOpt(...)`).

    Used standalone, as MindSpore's cell, `step(x, y)` (or `step(x, y, sample_weight)`,
    or `step((x, y))`) runs one training step and returns the loss: on the first call it
    builds the model, the optimizer and the stages, broadcasts the variables from rank 0
    under a launcher and compiles the step with `tf.function`; gradients are averaged
    across workers exactly as in `BoostModel.fit` (it is the same loop).

    Example:
        >>> step = keras_boost.BoostTrainOneStep(model, keras.optimizers.SGD(0.1, momentum=0.9),
        ...                                      loss_fn=keras.losses.MeanSquaredError())
        >>> loss = step(x, y)
    """

    _compiled = None  # {branch: tf.function}, made on the first call

    # ------------------------------------------------------- standalone cell
    def __call__(self, *inputs):
        """MindSpore's `cell(*inputs)`: one training step; returns the loss.

        `step(x, y)`, `step(x, y, sample_weight)` or `step((x, y))`. Builds itself on the
        first call and runs a compiled (`tf.function`) step; inside your own
        `tf.function` it runs inline.
        """
        if not inputs:
            raise TypeError("a boost step is called with the data of one step: step(x, y) or step((x, y))")
        data = inputs[0] if len(inputs) == 1 else tuple(inputs)
        if tf.inside_function():
            if not self.built:
                raise RuntimeError("call the boost step once outside tf.function (it builds the model, the "
                                   "optimizer and its state there), or build it first with step.build(state)")
            return self._standalone(data)
        if self._compiled is None:
            self._prepare_standalone(data)
            # The loop has no tensor-dependent Python control flow (tf.cond and tf.switch_case are
            # explicit), so AutoGraph need not convert it. One function per branch when the
            # branch can be chosen from Python, each compiled when first needed.
            self._compiled = {}
            self._plans = self.plans_branches()
        branch = self.next_branch(1)[0] if self._plans else None
        if branch not in self._compiled:
            self._compiled[branch] = tf.function(functools.partial(self._standalone, branch=branch), autograph=False)
        return self._compiled[branch](data)

    def _prepare_standalone(self, data):
        """Builds the model and the step, and makes the workers start from rank 0's variables."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        if not self.model.built or not self.model.trainable_variables:
            self.model(x, training=False)
        compiled_loss = getattr(self.model, "_compile_loss", None) is not None
        custom_loss = type(self.model).compute_loss is not keras.Model.compute_loss
        if self.loss_fn is None and not compiled_loss and not custom_loss:
            raise TypeError("a standalone boost step needs a loss: pass loss_fn=... (MindSpore's WithLossCell) or "
                            "compile the model with a loss")
        if not self.built:
            state = getattr(self.model, "boost_state", None)
            if state is None:
                state = self.state = BoostState()
            self.build(state)
        if distributed.size() > 1:
            own_state = getattr(self, "state", None)  # a BoostModel's own state is in training_variables
            variables = training_variables(self.model, self.optimizer,
                                           extra=own_state.variables if own_state is not None else ())
            distributed.broadcast_variables(variables, 0)

    def _standalone(self, data, branch=None):
        distributed.start_trace()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        scale = None
        if self.stage("loss_scale") is not None:
            scale = tf.identity(tf.reshape(tf.convert_to_tensor(self.stage("loss_scale").scale), []))
        with distributed.boost_step_scope():  # the optimizer's distributed apply passes through
            loss, _ = self._run(x, y, sample_weight, branch)
        if scale is None:
            return loss
        overflow = tf.cast(self.stage("loss_scale").last_overflow.value, tf.bool)
        return loss, overflow, scale

    # ------------------------------------------- MindSpore's cell methods
    def check_adasum_enable(self, optimizer=None, reducer_flag=None):
        """Whether this step combines updates by AdaSum (MindSpore's `check_adasum_enable`).

        True when an AdaSum stage is on and, once built, there is more than one group.
        `optimizer` (when given, it must be this step's) and `reducer_flag` (False: no
        data parallelism, so no AdaSum) are MindSpore's arguments.
        """
        if optimizer is not None and optimizer is not self.optimizer and getattr(
                optimizer, "optimizer", None) is not self.optimizer:
            raise ValueError("`optimizer` must be this step's optimizer")
        adasum = self.stage("adasum")
        if adasum is None or reducer_flag is False:
            return False
        return not adasum.built or adasum.groups > 1

    def _full_gradients(self, grads):
        if len(grads) != len(self._variables):
            raise ValueError(f"`grads` must hold one gradient per trainable variable ({len(self._variables)}), "
                             f"got {len(grads)}")
        pairs = [(g, i) for i, g in enumerate(grads) if g is not None]
        return [g for g, _ in pairs], [i for _, i in pairs]

    def gradient_accumulation_process(self, loss, grads):
        """Adds `grads` to the accumulation window and updates at its boundary; returns `loss`.

        MindSpore's `gradient_accumulation_process(loss, grads)`: `grads` are the (local)
        gradients of every trainable variable, in order; at the boundary the mean gradient
        goes through the rest of the step (allreduce, loss scale decision, GC, optimizer
        or AdaSum). Without an accumulation stage it updates at once.
        """
        self._require_built()
        grads, indices = self._full_gradients(grads)
        self._window_then_update(grads, indices)
        return loss

    def adasum_process(self, loss, grads):
        """Applies `grads` through AdaSum (MindSpore's `adasum_process`); returns `loss`.

        `grads` (one per trainable variable) are averaged inside this worker's AdaSum
        group, the optimizer takes a local step, and the weight deltas are combined
        across groups. Needs an AdaSum stage (`adasum=...`).
        """
        self._require_built()
        if self.stage("adasum") is None:
            raise ValueError("adasum_process needs an AdaSum stage: make the step with adasum=True or AdaSum(...)")
        grads, indices = self._full_gradients(grads)
        grads = self._communicate(grads, indices, self.stage("adasum").reduce)
        variables = [self._variables[i] for i in indices]
        self.stage("adasum").apply_update(self.optimizer, [tf.identity(g) for g in grads], variables)
        return loss

    def gradient_freeze_process(self, *inputs):
        """One training step through the freeze branch of the current group; returns the loss.

        MindSpore's `gradient_freeze_process(*inputs)`: the group `sequence[position]`
        gets gradients and the update, the sequence advances. Needs a freeze stage.
        """
        if self.stage("gradient_freeze") is None:
            raise ValueError("gradient_freeze_process needs a freeze stage: make the step with a FreezeOpt "
                             "optimizer or gradient_freeze=...")
        return self(*inputs)



class BoostTrainOneStepWithLossScale(BoostTrainOneStep):
    """The boost step with loss scaling (MindSpore's BoostTrainOneStepWithLossScaleCell).

    Args:
        model: the Keras model being trained.
        optimizer: a `keras.optimizers.Optimizer`.
        scale_sense: a `DynamicLossScale` / `FixedLossScale`, or a tensor of shape () or
            (1,) holding a fixed scale (change it between steps with `set_sense_scale`).
        **options: the other options of `BoostTrainOneStep`.

    Example:
        >>> step = keras_boost.BoostTrainOneStepWithLossScale(
        ...     model, optimizer, keras_boost.DynamicLossScale())
    """

    def __init__(self, model, optimizer, scale_sense, **options):
        super().__init__(model, optimizer, loss_scale=as_loss_scale(scale_sense), **options)

    def __call__(self, *inputs):
        """One training step; returns `(loss, overflow, scale)` as MindSpore's cell: the
        loss, whether this step's gradients overflowed, and the scale used in this step."""
        return super().__call__(*inputs)

    def set_sense_scale(self, value):
        """Sets the loss scale from the host (MindSpore's `set_sense_scale`)."""
        if not isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, numbers.Real)) or isinstance(value, bool):
            raise TypeError(f"The input type must be Tensor, but got {type(value).__name__}")
        self.stage("loss_scale").scale.assign(tf.reshape(tf.cast(value, tf.float32), []))
