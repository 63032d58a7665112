"""The boost step: one training step as a loop over stages at fixed hook points.

`BoostTrainOneStep` is MindSpore's `BoostTrainOneStepCell`. It knows the hook points of
`keras_boost.step.contract`, not the features: the stages come from the registry
(`keras_boost.step.registry`), in its order, and each acts only at the hooks it overrides.

    [select_branch: group k] -> forward + loss -> scale_loss -> gradients of group k only
    -> local_gradients -> [window: go on only at a boundary]
    -> encode -> reduce (default: each gradient to Horovod when ready, fused there; gradient_split_groups:
       one grouped allreduce per group) -> decode
    -> [agree_finite -> should_skip: one decision, identical on every worker]
    -> transform -> apply_update (default: optimizer.apply) -> after_update -> logs

With several branches (gradient freezing), `BoostModel.fit` and the standalone step compile
one function per branch, when it is first needed, and choose it from Python between steps
(`keras_boost.step.dispatch`): the first step traces one branch, not all of them, and each
branch's graph holds only its own forward and backward pass. Inside a caller's own
`tf.function` the branches are chosen with `tf.switch_case` instead; only the taken branch
runs. Either way the backward pass through the frozen prefix is never computed.
"""

import functools
import numbers

import keras
import numpy as np
import tensorflow as tf

from keras_boost import _keras_compat, _validation, distributed
from keras_boost.stages.loss_scale import all_finite, as_loss_scale
from keras_boost.step import registry
from keras_boost.step.contract import SINGLE_HOOKS, Stage, StepContext


def check_sens(sens):
    if isinstance(sens, bool) or not isinstance(sens, numbers.Real):
        raise TypeError(f"`sens` must be a finite non-zero number (the scale of the loss gradient), got {sens!r} "
                        f"({type(sens).__name__}).")
    if sens == 0 or not np.isfinite(sens):
        raise ValueError(f"`sens` must be a finite non-zero number (the scale of the loss gradient), got {sens!r} "
                         f"({type(sens).__name__}).")
    return float(sens)


def run_if(predicate, fn):
    """Runs `fn` (for its effects) inside the compiled step only when `predicate` holds."""
    def taken():
        fn()
        return tf.constant(True)

    return tf.cond(predicate, taken, lambda: tf.constant(False))


def _call_compute_loss(model, x, y, y_pred, sample_weight):
    """`model.compute_loss(...)`, passing `training` only when the override accepts it (as Keras does)."""
    kwargs = {"x": x, "y": y, "y_pred": y_pred, "sample_weight": sample_weight}
    if _accepts_training(type(model).compute_loss):
        kwargs["training"] = True
    return model.compute_loss(**kwargs)


@functools.lru_cache(maxsize=None)
def _accepts_training(compute_loss):
    import inspect

    parameters = inspect.signature(compute_loss).parameters
    return "training" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


class BoostTrainOneStep:
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

    def __init__(self, model, optimizer, sens=1.0, *, gradient_split_groups=None, stages=(), loss_fn=None,
                 **options):
        from keras_boost.stages.freeze import FreezeOpt

        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model, got {model!r} ({type(model).__name__}).")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"`optimizer` must be a keras.optimizers.Optimizer (a FreezeOpt included), got "
                            f"{type(optimizer).__name__}.")
        if isinstance(optimizer, FreezeOpt):
            given = options.get("gradient_freeze")
            if given is not None and given is not optimizer:
                raise ValueError("the optimizer is a FreezeOpt and `gradient_freeze` is given too: pass the freeze "
                                 "groups once, either as the optimizer or as gradient_freeze")
            options["gradient_freeze"] = optimizer
            optimizer = optimizer.optimizer
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"`loss_fn` must be None or a callable loss(y_true, y_pred), got {loss_fn!r} "
                            f"({type(loss_fn).__name__}).")
        self.loss_fn = loss_fn
        self._compiled = None
        options.setdefault("nan_guard", True)
        if options["nan_guard"] is not None:
            _validation.check_bool("nan_guard", options["nan_guard"])
        self.model = model
        self.optimizer = optimizer
        self.sens = check_sens(sens)
        self.split_points = _validation.check_split_points(gradient_split_groups)
        self.stages = registry.make_stages(options, model) + [_check_stage(s) for s in stages]
        for hook in SINGLE_HOOKS:
            owners = [type(s).__name__ for s in self.stages if s.overrides(hook)]
            if len(owners) > 1:
                raise ValueError(f"only one stage may define the `{hook}` hook; got {owners}")
        self.built = False

    # -------------------------------------------------------------- stages
    def stage(self, option):
        """The stage made from `compile(<option>=...)`, or None."""
        return next((s for s in self.stages if s.option == option), None)

    @property
    def loss_scale(self):
        return self.stage("loss_scale")

    @property
    def accumulation(self):
        return self.stage("gradient_accumulation")

    @property
    def freeze(self):
        return self.stage("gradient_freeze")

    @property
    def centralization(self):
        return self.stage("gradient_centralization")

    @property
    def adasum(self):
        return self.stage("adasum")

    @property
    def nan_guard(self):
        return self.stage("nan_guard") is not None

    def _with(self, hook):
        return [s for s in self.stages if s.overrides(hook)]

    # --------------------------------------------------------------- build
    def build(self, state):
        """Builds the optimizer and every stage (eagerly), in registry order."""
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
                stage.build(context)
            selecting = self._with("select_branch")
            self._selector = None
            self._groups = [list(range(len(variables)))]
            if selecting:
                selection = selecting[0].select_branch()
                if selection is not None:
                    self._groups, self._selector = selection
            self._needs_finite = any(s.needs_finite for s in self.stages)
        self.built = True

    # ---------------------------------------------------------------- step
    def train_step(self, data, branch=None):
        """One step inside a compiled `train_step` (what `BoostModel.train_step` runs); returns the logs.

        `branch`: None chooses the freeze group inside the step (`tf.switch_case`); a Python
        int compiles only that group's step (the caller chose it with `next_branch`).
        """
        with distributed.boost_step_scope():  # the optimizer's distributed apply passes through
            return self._train_step(data, branch)

    def plans_branches(self):
        """Whether the branch of each step can be chosen from Python (`next_branch`)."""
        self._require_built()
        return len(self._groups) > 1 and self._with("select_branch")[0].upcoming_branch() is not None

    def next_branch(self, limit):
        """(branch, steps): the branch the next step trains, and for how many steps in a row (1..limit).

        Read from the state variables between steps, so it follows a restored or re-formed
        run; identical on every worker, whose state is identical.
        """
        branch, updates = self._with("select_branch")[0].upcoming_branch()
        windowing = self._with("window")
        window = windowing[0].steps_to_boundary() if windowing else (1, 1)
        if window is None:  # a window that cannot say where it ends: one step at a time
            return branch, 1
        first, per_update = window
        return branch, max(1, min(limit, first + (updates - 1) * per_update))

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
        """The step through the branch of this step's freeze group; returns (loss, y_pred)."""
        if len(self._groups) == 1:
            return self._branch(self._groups[0], x, y, sample_weight)
        if branch is not None:
            self._with("select_branch")[0].enter_branch(branch)
            return self._branch(self._groups[branch], x, y, sample_weight)
        branches = [functools.partial(self._branch, indices, x, y, sample_weight) for indices in self._groups]
        return tf.switch_case(self._selector(), branches)

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
            from keras_boost.step.state import BoostState

            state = getattr(self.model, "boost_state", None)
            if state is None:
                state = self.state = BoostState()
            self.build(state)
        if distributed.size() > 1:
            from keras_boost.step.state import state_variables

            variables = state_variables(self.model) + list(self.optimizer.variables)
            own_state = getattr(self, "state", None)  # a BoostModel's own state is in state_variables
            if own_state is not None:
                variables += list(own_state.variables)
            distributed.broadcast_variables(variables, 0)

    def _standalone(self, data, branch=None):
        distributed.start_trace()
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        scale = None
        if self.loss_scale is not None:
            scale = tf.identity(tf.reshape(tf.convert_to_tensor(self.loss_scale.scale), []))
        with distributed.boost_step_scope():  # the optimizer's distributed apply passes through
            loss, _ = self._run(x, y, sample_weight, branch)
        if scale is None:
            return loss
        overflow = tf.cast(self.loss_scale.last_overflow.value, tf.bool)
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
        adasum = self.adasum
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
        windowing = self._with("window")
        window = windowing[0].window(grads, indices) if windowing else None
        if window is None:
            self._update(grads, indices)
        else:
            def update_from_window():
                self._update(window.grads(), indices)
                window.close()

            run_if(window.boundary, update_from_window)
        return loss

    def adasum_process(self, loss, grads):
        """Applies `grads` through AdaSum (MindSpore's `adasum_process`); returns `loss`.

        `grads` (one per trainable variable) are averaged inside this worker's AdaSum
        group, the optimizer takes a local step, and the weight deltas are combined
        across groups. Needs an AdaSum stage (`adasum=...`).
        """
        self._require_built()
        if self.adasum is None:
            raise ValueError("adasum_process needs an AdaSum stage: make the step with adasum=True or AdaSum(...)")
        grads, indices = self._full_gradients(grads)
        grads = self._communicate(grads, indices, self.adasum.reduce)
        variables = [self._variables[i] for i in indices]
        self.adasum.apply_update(self.optimizer, [tf.identity(g) for g in grads], variables)
        return loss

    def gradient_freeze_process(self, *inputs):
        """One training step through the freeze branch of the current group; returns the loss.

        MindSpore's `gradient_freeze_process(*inputs)`: the group `sequence[position]`
        gets gradients and the update, the sequence advances. Needs a freeze stage.
        """
        if self.freeze is None:
            raise ValueError("gradient_freeze_process needs a freeze stage: make the step with a FreezeOpt "
                             "optimizer or gradient_freeze=...")
        return self(*inputs)

    def _require_built(self):
        if not self.built:
            raise RuntimeError("the step is not built yet: call it once on data (step(x, y)) or build(state) first")

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
            y_pred = self.model(x, training=True)
            if self.loss_fn is None:
                loss = _call_compute_loss(self.model, x, y, y_pred, sample_weight)
            else:
                loss = self._loss_fn_loss(y, y_pred, sample_weight)
            target = loss * self.sens if self.sens != 1.0 else loss
            for stage in self._with("scale_loss"):
                target = stage.scale_loss(target)
        grads = tape.gradient(target, watched)
        connected = [(g, i) for g, i in zip(grads, indices) if g is not None]
        grads = [g for g, _ in connected]
        indices = [i for _, i in connected]
        for stage in self._with("local_gradients"):
            grads = stage.local_gradients(grads, indices)
        windowing = self._with("window")
        window = windowing[0].window(grads, indices) if windowing else None
        if window is None:
            self._update(grads, indices)
        else:
            def update_from_window():
                self._update(window.grads(), indices)
                window.close()

            run_if(window.boundary, update_from_window)
        return loss, y_pred

    def _loss_fn_loss(self, y, y_pred, sample_weight):
        if sample_weight is None:
            loss = self.loss_fn(y, y_pred)
        else:
            loss = self.loss_fn(y, y_pred, sample_weight)
        loss = tf.reduce_mean(tf.cast(loss, tf.float32))
        if self.model.losses:
            loss += tf.add_n([tf.cast(extra, tf.float32) for extra in self.model.losses])
        return loss

    def _update(self, grads, indices):
        """Communicates once, decides for all workers whether to apply, applies, then after_update."""
        grads = self._communicate(grads, indices, self._reduce)
        variables = [self._variables[i] for i in indices]
        finite = None
        if self._needs_finite:
            finite = all_finite(grads)
            for stage in self._with("agree_finite"):
                finite = stage.agree_finite(finite)
        skips = [s for s in (stage.should_skip(finite) for stage in self._with("should_skip")) if s is not None]
        if not skips:
            self._apply(grads, variables)
        else:
            skip = skips[0] if len(skips) == 1 else tf.reduce_any(tf.stack(skips))
            run_if(tf.logical_not(skip), lambda: self._apply(grads, variables))
        for stage in self._with("after_update"):
            stage.after_update()

    def _communicate(self, grads, indices, reduce):
        """`reduce` between the `encode` hooks (registry order) and the `decode` hooks (reverse order)."""
        for stage in self._with("encode"):
            grads = stage.encode(grads, indices)
        grads = reduce(grads, indices)
        for stage in reversed(self._with("decode")):
            grads = stage.decode(grads, indices)
        return grads

    def _reduce(self, grads, indices):
        reducing = self._with("reduce")
        if reducing:
            return reducing[0].reduce(grads, indices)
        if distributed.size() == 1:
            return grads
        if not self.split_points:  # each gradient to Horovod as soon as it exists; Horovod fuses them
            return distributed.allreduce_each(grads)
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
        for stage in self._with("transform"):
            grads = stage.transform(grads, variables)
        applying = self._with("apply_update")
        if applying:
            applying[0].apply_update(self.optimizer, grads, variables)
        else:
            self.optimizer.apply(grads, variables)


def _check_stage(stage):
    if not isinstance(stage, Stage):
        raise TypeError(f"`stages` must hold keras_boost Stage objects, got {stage!r} ({type(stage).__name__}).")
    return stage


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
        self.loss_scale.scale.assign(tf.reshape(tf.cast(value, tf.float32), []))
