"""The boost step: one training step made of small stages with their own state.

`BoostTrainOneStep` is the seed's `BoostTrainOneStepCell`. It owns the stages and runs
them in this fixed order inside the compiled `train_step`:

    [freeze: pick group k] -> forward + loss -> scale loss -> gradients of group k only
    -> unscale -> [accumulate locally; continue only at a window boundary]
    -> one fused allreduce (inside the AdaSum group when AdaSum is on)
    -> overflow decided on the reduced gradients (identical on every worker)
    -> gradient centralization -> apply (optimizer step | AdaSum: local step + combine)
    -> loss-scale update, freeze position advance -> logs

Each stage creates its variables in the model's `BoostState` layer, so checkpoints carry
them. With gradient freezing, one branch per group is traced once and chosen inside the
compiled step with `tf.switch_case`; only the taken branch runs, so the backward pass
through the frozen prefix is never computed.
"""

import functools
import numbers

import keras
import numpy as np
import tensorflow as tf
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_boost import distributed
from keras_boost.loss_scale import LossScale, all_finite, as_loss_scale


def check_sens(sens):
    if isinstance(sens, bool) or not isinstance(sens, numbers.Real):
        raise TypeError(f"sens must be a number (the scale of the loss gradient), got {sens!r} of type "
                        f"{type(sens).__name__}")
    if sens == 0 or not np.isfinite(sens):
        raise ValueError(f"sens must be finite and non-zero, got {sens!r}")
    return float(sens)


def _run_if(predicate, fn):
    """Runs `fn` (for its effects) inside the compiled step only when `predicate` holds."""
    def taken():
        fn()
        return tf.constant(True)

    return tf.cond(predicate, taken, lambda: tf.constant(False))


def _check_split_points(points):
    if points is None:
        return []
    if not isinstance(points, (list, tuple)) or not all(
            isinstance(p, numbers.Integral) and not isinstance(p, bool) and p > 0 for p in points):
        raise ValueError(f"gradient_split_groups must be None or a list of positive integers, got {points!r}")
    if list(points) != sorted(set(points)):
        raise ValueError(f"gradient_split_groups must be strictly increasing, got {list(points)}")
    return [int(p) for p in points]


class BoostTrainOneStep:
    """Runs one boost training step of `model` with `optimizer` (the seed's BoostTrainOneStepCell).

    Args:
        model: the Keras model being trained (usually a `BoostModel`, which owns the step).
        optimizer: a built or unbuilt `keras.optimizers.Optimizer`.
        sens: scale of the loss gradient, default 1.0. As in the seed the gradients stay
            multiplied by it (with plain SGD it scales the learning rate); use a loss-scale
            stage for mixed precision instead.
        loss_scale: a loss-scale stage (`DynamicLossScale`, `FixedLossScale`) or None.
        gradient_accumulation: a `GradientAccumulation` stage or None.
        gradient_freeze: a `FreezeSchedule` stage or None.
        gradient_centralization: a `GradientCentralization` stage or None.
        adasum: an `AdaSum` stage or None.
        gradient_split_groups: increasing variable indices at which a new fused
            allreduce starts, or None for one fused allreduce of all gradients.
        nan_guard: without loss scaling, an update whose averaged gradient is not finite
            is not applied and `BoostModel.fit` stops with `FloatingPointError` (default
            True). False applies it anyway, as plain Keras does.

    Example:
        >>> step = keras_boost.BoostTrainOneStep(model, keras.optimizers.SGD(0.1))
        >>> logs = step(batch)  # inside a compiled train_step
    """

    def __init__(self, model, optimizer, sens=1.0, *, loss_scale=None, gradient_accumulation=None,
                 gradient_freeze=None, gradient_centralization=None, adasum=None, gradient_split_groups=None,
                 nan_guard=True):
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
        if loss_scale is not None and not isinstance(loss_scale, LossScale):
            raise TypeError(f"loss_scale must be a DynamicLossScale, FixedLossScale or None, got {loss_scale!r}")
        self.model = model
        self.optimizer = optimizer
        self.sens = check_sens(sens)
        self.loss_scale = loss_scale
        self.accumulation = gradient_accumulation
        self.freeze = gradient_freeze
        self.centralization = gradient_centralization
        self.adasum = adasum
        self.split_points = _check_split_points(gradient_split_groups)
        if not isinstance(nan_guard, bool):
            raise TypeError(f"nan_guard must be a bool, got {nan_guard!r}")
        self.nan_guard = nan_guard
        self.built = False

    # ----------------------------------------------------------------- build
    def build(self, state):
        """Creates every stage's variables in `state` and builds the optimizer (eagerly)."""
        if self.built:
            return
        distributed.init()
        with tf.init_scope():
            variables = list(self.model.trainable_variables)
            if not self.optimizer.built:
                self.optimizer.build(variables)
            self._variables = variables
            self._groups = [list(range(len(variables)))]
            if self.loss_scale is not None:
                self.loss_scale.build(state)
            elif self.nan_guard:
                self.nonfinite_updates = state.add_state("guard/nonfinite_updates", 0, "int64")
            if self.accumulation is not None:
                self.accumulation.build(state, variables)
            if self.freeze is not None:
                self.freeze.build(state, self.model, self.optimizer)
                self._groups = self.freeze.group_indices
            if self.adasum is not None:
                self.adasum.build(state, variables)
        self.built = True

    # ------------------------------------------------------------------ step
    def __call__(self, data):
        with distributed.boost_step_scope():  # the optimizer's distributed apply passes through
            return self._call(data)

    def _call(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        if len(self._groups) == 1:
            loss, y_pred = self._branch(self._groups[0], x, y, sample_weight)
        else:
            group = self.freeze.current_group()
            branches = [functools.partial(self._branch, indices, x, y, sample_weight) for indices in self._groups]
            loss, y_pred = tf.switch_case(group, branches)
        batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
        self.model._loss_tracker.update_state(loss_module.unscale_loss_for_distribution(loss),
                                              sample_weight=batch_size)
        logs = dict(self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight))
        logs.update(self.logs())
        return logs

    def logs(self):
        """The boost scalars of the last step (identical on every worker)."""
        logs = {}
        if self.loss_scale is not None:
            logs.update(self.loss_scale.logs())
        if self.freeze is not None:
            logs.update(self.freeze.logs())
        return logs

    def _branch(self, indices, x, y, sample_weight):
        """Forward, backward for the variables at `indices` only, then the update stages."""
        watched = [self._variables[i].value for i in indices]  # the tf.Variables under the Keras ones
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(watched)
            y_pred = self.model(x, training=True)
            # Keras' wrapper passes `training` only to a compute_loss override that takes it.
            loss = self.model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            target = loss * self.sens if self.sens != 1.0 else loss
            if self.loss_scale is not None:
                target = self.loss_scale.scale_loss(target)
        grads = tape.gradient(target, watched)
        connected = [(g, i) for g, i in zip(grads, indices) if g is not None]
        grads = [g for g, _ in connected]
        indices = [i for _, i in connected]
        if self.loss_scale is not None:
            grads = self.loss_scale.unscale(grads)
        if self.accumulation is None:
            self._update(grads, indices)
        else:
            boundary = self.accumulation.accumulate(grads, indices)
            _run_if(boundary, lambda: self._update_from_window(indices))
        return loss, y_pred

    def _update_from_window(self, indices):
        self._update(self.accumulation.mean(indices), indices)
        self.accumulation.reset(indices)

    def _update(self, grads, indices):
        """Communicates once, decides overflow for all workers, applies, updates stage state."""
        grads = self._reduce(grads, indices)
        variables = [self._variables[i] for i in indices]
        if self.loss_scale is None and not self.nan_guard:
            self._apply(grads, variables)
        else:
            finite = all_finite(grads)
            if self.adasum is not None:  # gradients were reduced inside the group only
                finite = self.adasum.all_agree(finite)
            if self.loss_scale is not None:
                skip = self.loss_scale.update(finite)
            else:  # the guard: never write non-finite values into the weights
                skip = tf.logical_not(finite)
                self.nonfinite_updates.assign_add(tf.cast(skip, tf.int64))
            _run_if(tf.logical_not(skip), lambda: self._apply(grads, variables))
        if self.freeze is not None:
            self.freeze.advance()

    def _reduce(self, grads, indices):
        if self.adasum is not None:
            return self.adasum.reduce_gradients(grads)
        if distributed.size() == 1:
            return grads
        buckets = {}
        for position, index in enumerate(indices):
            buckets.setdefault(int(np.searchsorted(self.split_points, index, side="right")), []).append(position)
        reduced = [None] * len(grads)
        for positions in buckets.values():
            for position, g in zip(positions, distributed.grouped_allreduce([grads[p] for p in positions])):
                reduced[position] = g
        return reduced

    def _apply(self, grads, variables):
        # Keras' TF optimizer passes the gradients through a custom_gradient that wants them
        # all from one graph; inside a cond some would otherwise be captures of the outer graph.
        grads = [tf.identity(g) for g in grads]
        if self.centralization is not None:
            grads = self.centralization.apply(grads, variables)
        if self.adasum is not None:
            self.adasum.apply(self.optimizer, grads, variables)
        else:
            self.optimizer.apply(grads, variables)


class BoostTrainOneStepWithLossScale(BoostTrainOneStep):
    """The boost step with loss scaling (the seed's BoostTrainOneStepWithLossScaleCell).

    Args:
        model: the Keras model being trained.
        optimizer: a `keras.optimizers.Optimizer`.
        scale_sense: a `DynamicLossScale` / `FixedLossScale`, or a tensor of shape () or
            (1,) holding a fixed scale (change it between steps with `set_sense_scale`).
        **stages: the other stages of `BoostTrainOneStep`.

    Example:
        >>> step = keras_boost.BoostTrainOneStepWithLossScale(
        ...     model, optimizer, keras_boost.DynamicLossScale())
    """

    def __init__(self, model, optimizer, scale_sense, **stages):
        super().__init__(model, optimizer, loss_scale=as_loss_scale(scale_sense), **stages)

    def set_sense_scale(self, value):
        """Sets the loss scale from the host (the seed's `set_sense_scale`)."""
        if not isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, numbers.Real)) or isinstance(value, bool):
            raise TypeError(f"The input type must be Tensor, but got {type(value).__name__}")
        self.loss_scale.scale.assign(tf.reshape(tf.cast(value, tf.float32), []))
