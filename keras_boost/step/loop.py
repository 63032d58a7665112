"""The boost step: one training step as a loop over stages at fixed hook points.

`BoostStep` is the loop of MindSpore's `BoostTrainOneStepCell`. It knows the hook points of
`keras_boost.core.contract`, not the features: the stages come from the registry
(`keras_boost.step.registry`), in its order, and each acts only at the hooks it overrides.

    [select_branch: branch k] -> [around_forward] forward + loss -> scale_loss
    -> gradients of branch k's variables only -> local_gradients -> [window: go on only at a boundary]
    -> encode -> reduce (default: one grouped allreduce; gradient_split_groups: one per group, or
       "each": every gradient to Horovod as soon as it exists; the workers' stop votes ride along) -> decode
    -> [column_sums -> agree_finite -> should_skip: one decision, identical on every worker]
    -> transform -> [around_update] apply_update (default: optimizer.apply) -> after_update -> logs

With several branches (a `select_branch` stage), `BoostModel.fit` and the standalone step compile
one function per branch, when it is first needed, and choose it from Python between steps
(`keras_boost.step.dispatch`): the first step traces one branch, not all of them, and each
branch's graph holds only its own forward and backward pass. Inside a caller's own
`tf.function` the branches are chosen with `tf.switch_case` instead; only the taken branch
runs. Either way the backward pass through the variables a branch leaves out is never computed.
"""

import contextlib
import functools

import keras
import tensorflow as tf

from keras_boost import _keras_compat, _validation, distributed
from keras_boost.core.contract import SINGLE_HOOKS, StepContext, all_finite, run_if
from keras_boost.step import registry
from keras_boost.step.planning import BranchPlanning
from keras_boost.step.votes import StopVotes, reduce_with_votes


class BoostStep(BranchPlanning):
    """One boost training step of `model` with `optimizer`: the loop over the stages' hooks.

    Args:
        model: the Keras model being trained (usually a `BoostModel`, which owns the step).
        optimizer: a built or unbuilt `keras.optimizers.Optimizer`; an optimizer adapter of a
            stage is unwrapped into that stage (`registry.unwrap_optimizer`).
        sens: scale of the loss gradient, default 1.0. As in MindSpore the gradients stay
            multiplied by it (with plain SGD it scales the learning rate); use a loss-scale
            stage for mixed precision instead.
        gradient_split_groups: None (one grouped allreduce per update), increasing
            variable indices at which a new grouped allreduce starts, or "each" (every
            gradient to Horovod as soon as the backward pass produces it).
        stages: more `Stage` objects to run (after the registry's), e.g. your own.
        loss_fn: the loss, `loss_fn(y, y_pred[, sample_weight])` (MindSpore's
            `WithLossCell(network, loss_fn)`); default: the loss the model was compiled
            with. Regularization losses of the model are added.
        **options: the stage options of `BoostModel.compile` (`registry.options()`, those
            of stages registered with `registry.register` included), turned into stages by
            the registry; a ready stage object is accepted too.

    The step gives each stage by its option: `step.stage(option)` (None when off). MindSpore's
    callable cell over this loop is `keras_boost.BoostTrainOneStep` (`keras_boost/mindspore/cells.py`).
    """

    def __init__(self, model, optimizer, sens=1.0, *, gradient_split_groups=None, stages=(), loss_fn=None,
                 **options):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model, got {model!r} ({type(model).__name__}).")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"`optimizer` must be a keras.optimizers.Optimizer (an optimizer adapter included), got "
                            f"{type(optimizer).__name__}.")
        optimizer = registry.unwrap_optimizer(optimizer, options)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"`loss_fn` must be None or a callable loss(y_true, y_pred), got {loss_fn!r} "
                            f"({type(loss_fn).__name__}).")
        self.loss_fn = loss_fn
        self.model = model
        self.optimizer = optimizer
        self.sens = _validation.check_sens(sens)
        self.split_points = _validation.check_split_points(gradient_split_groups)
        self.stop_votes = None  # made by build() on several workers (`StopVotes`)
        self.stages = registry.make_stages(options, model, extra=[registry.check_stage(s) for s in stages],
                                           defaults={"gradient_split_groups": gradient_split_groups})
        for stage in self.stages:
            stage.check_optimizer(optimizer)
        for hook in SINGLE_HOOKS:
            owners = [type(s).__name__ for s in self.stages if s.overrides(hook)]
            if len(owners) > 1:
                raise ValueError(f"only one stage may define the `{hook}` hook; got {owners}")
        self.built = False

    # -------------------------------------------------------------- stages
    def stage(self, option):
        """The stage made from `compile(<option>=...)`, or None."""
        return next((s for s in self.stages if s.option == option), None)

    def _with(self, hook):
        return [s for s in self.stages if s.overrides(hook)]

    # --------------------------------------------------------------- build
    def build(self, state, later=()):
        """Builds the optimizer and every stage (eagerly), in registry order.

        `later`: options of stages not built now (elastic training builds the stages that
        depend on the set of workers at their first agreement, `Stage.workers_changed`).
        """
        if self.built:
            return
        distributed.init()
        with tf.init_scope():
            variables = list(self.model.trainable_variables)
            if not self.optimizer.built:
                self.optimizer.build(variables)
            self._variables = variables
            context = StepContext(self.model, self.optimizer, variables, state)
            for stage in self.stages:
                if stage.option not in later:
                    stage.build(context)
            selecting = self._with("select_branch")
            self._selector = None
            self._groups = [list(range(len(variables)))]
            if selecting:
                selection = selecting[0].select_branch()
                if selection is not None:
                    self._groups, self._selector = selection
            self._needs_finite = any(s.needs_finite for s in self.stages)
            if distributed.size() > 1 and not distributed.elastic_launch():
                self.stop_votes = StopVotes()  # an elastic job re-forms instead of stopping together
        self.built = True

    # ---------------------------------------------------------------- step
    def train_step(self, data, branch=None):
        """One step inside a compiled `train_step` (what `BoostModel.train_step` runs); returns the logs.

        `branch`: None chooses the branch inside the step (`tf.switch_case`); a Python
        int compiles only that branch's step (the caller chose it with `next_branch`).
        """
        with distributed.boost_step_scope():  # the optimizer's distributed apply passes through
            return self._train_step(data, branch)

    def _train_step(self, data, branch=None):
        distributed.start_trace()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, y_pred = self._run(x, y, sample_weight, branch)
        batch_size = tf.shape(tf.nest.flatten(x)[0])[0]
        _keras_compat.update_loss_tracker(self.model, loss, batch_size)
        logs = dict(self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight))
        logs.update(self.logs())
        return logs

    def _run(self, x, y, sample_weight, branch=None):
        """The step through this step's branch; returns (loss, y_pred)."""
        if len(self._groups) == 1:
            return self._branch(self._groups[0], x, y, sample_weight)
        if branch is not None:
            self._with("select_branch")[0].enter_branch(branch)
            return self._branch(self._groups[branch], x, y, sample_weight)
        branches = [functools.partial(self._branch, indices, x, y, sample_weight) for indices in self._groups]
        return tf.switch_case(self._selector(), branches)

    def _require_built(self):
        if not self.built:
            raise RuntimeError("the step is not built yet: call it once on data (step(x, y)) or build(state) first")

    def log_keys(self):
        """The keys of the boost scalars the stages log (`Stage.log_keys`), known before the step is built."""
        return [key for stage in self.stages for key in stage.log_keys]

    def logs(self):
        """The boost scalars of the last step (identical on every worker)."""
        logs = {}
        for stage in self._with("logs"):
            logs.update(stage.logs())
        return logs

    def _branch(self, indices, x, y, sample_weight):
        """Forward, backward for the variables at `indices` only, then the update hooks."""
        watched = [self._variables[i].value for i in indices]  # the tf.Variables under the Keras ones
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(watched)
            with contextlib.ExitStack() as around:
                for stage in self._with("around_forward"):
                    around.enter_context(stage.around_forward(self.model))
                y_pred = self.model(x, training=True)
            if self.loss_fn is None:
                loss = _keras_compat.compute_loss(self.model, x, y, y_pred, sample_weight)
            else:
                loss = self._loss_fn_loss(y, y_pred, sample_weight)
            target = loss * self.sens if self.sens != 1.0 else loss
            for stage in self._with("scale_loss"):
                target = stage.scale_loss(target)
            # The optimizer's own scaling (Keras' `LossScaleOptimizer`, or the scale factor an
            # optimizer was made with), which its `apply` divides out again, as in keras.Model's
            # step. A plain optimizer returns the loss as it is (no op).
            target = self.optimizer.scale_loss(target)
        grads = tape.gradient(target, watched)
        connected = [(g, i) for g, i in zip(grads, indices) if g is not None]
        grads = [g for g, _ in connected]
        indices = [i for _, i in connected]
        for stage in self._with("local_gradients"):
            grads = stage.local_gradients(grads, indices)
        # Nothing of the update may run before this batch exists. TensorFlow inlines Keras'
        # step function into the caller's graph, so an op that reads no gradient (the
        # optimizer's `iterations += 1`, a stage's counter) would otherwise also run on the
        # call whose `get_next` ends the epoch of a dataset of unknown length: keras.Model
        # counts one update more per such epoch than it applied (Adam's bias correction and
        # learning-rate schedules then read it). The loss exists before every gradient, so
        # this dependency delays nothing else.
        with tf.control_dependencies([loss]):
            self._window_then_update(grads, indices)
        return loss, y_pred

    def _window_then_update(self, grads, indices):
        """Adds to the window of a `window` stage and updates at its boundary; without one, updates now."""
        windowing = self._with("window")
        window = windowing[0].window(grads, indices) if windowing else None
        if window is None:
            self._update(grads, indices)
            return

        def update_from_window():
            self._update(window.grads(), indices, in_cond=True)
            window.close()

        run_if(window.boundary, update_from_window)

    def _loss_fn_loss(self, y, y_pred, sample_weight):
        if sample_weight is None:
            loss = self.loss_fn(y, y_pred)
        else:
            loss = self.loss_fn(y, y_pred, sample_weight)
        loss = tf.reduce_mean(tf.cast(loss, tf.float32))
        if self.model.losses:
            loss += tf.add_n([tf.cast(extra, tf.float32) for extra in self.model.losses])
        return loss

    def _update(self, grads, indices, in_cond=False):
        """Communicates once, decides for all workers whether to apply, applies, then after_update.

        `in_cond`: this runs inside a `tf.cond` branch (a window's boundary).
        """
        reducer = self._with("reduce")[0]
        grads = self._communicate(grads, indices, reducer.reduce, votes=self.stop_votes,
                                  carries=reducer.carries_votes)
        variables = [self._variables[i] for i in indices]
        finite = sums = None
        if self._needs_finite:
            summing = self._with("column_sums")  # the check reads a stage's sums, not the gradients again
            sums = summing[0].column_sums(grads, variables) if summing else None
            finite = all_finite(grads, sums)
            for stage in self._with("agree_finite"):
                finite = stage.agree_finite(finite)
        skips = [s for s in (stage.should_skip(finite) for stage in self._with("should_skip")) if s is not None]
        if not skips:
            self._apply(grads, variables, sums, in_cond=in_cond)
        else:
            skip = skips[0] if len(skips) == 1 else tf.reduce_any(tf.stack(skips))
            run_if(tf.logical_not(skip), lambda: self._apply(grads, variables, sums, in_cond=True))
        for stage in self._with("after_update"):
            stage.after_update()

    def _communicate(self, grads, indices, reduce, votes=None, carries=False):
        """`reduce` between the `encode` hooks (registry order) and the `decode` hooks (reverse order).

        `votes` (`StopVotes`): the workers' requests to stop are averaged with this update,
        as one more scalar in the gradients' own collective where the reduce `carries` it
        (the default average: no collective added), in a scalar allreduce of their own
        otherwise.
        """
        for stage in self._with("encode"):
            grads = stage.encode(grads, indices)
        grads = reduce_with_votes(reduce, grads, indices, votes, carries)
        for stage in reversed(self._with("decode")):
            grads = stage.decode(grads, indices)
        return grads

    def _apply(self, grads, variables, sums=None, in_cond=False):
        if in_cond:
            # Keras' TF optimizer passes the gradients through a custom_gradient that wants
            # them all from one graph; inside a cond some would otherwise be captures of the
            # outer graph. Outside one they already are (keras.Model's step has no copy either).
            grads = [tf.identity(g) for g in grads]
        for stage in self._with("transform"):
            if sums is not None and stage.overrides("column_sums"):
                grads = stage.transform(grads, variables, sums=sums)
            else:
                grads = stage.transform(grads, variables)
                sums = None  # the gradients changed: sums of them before no longer hold
        with contextlib.ExitStack() as around:
            for stage in self._with("around_update"):
                around.enter_context(stage.around_update(self.optimizer))
            self._with("apply_update")[0].apply_update(self.optimizer, grads, variables)
