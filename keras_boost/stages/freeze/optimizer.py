"""Gradient freezing as MindSpore spells it: `FreezeOpt`, `freeze_cell` and `GradientFreeze`.

`FreezeOpt` is a Keras optimizer adapter (like `keras.optimizers.LossScaleOptimizer`): the
boost step unwraps it into its freeze stage (`stage.py`); any other Keras model applies the
gradients of the step's group only. `GradientFreeze` makes the groups and the sequence of
a model; `freeze_cell` turns a `FreezeOpt` into the plan the step compiles. Unlike
MindSpore, keras_boost keeps one optimizer, with one state per variable, for all groups.
"""

import keras
import tensorflow as tf

from keras_boost._validation import check_int, check_steps
from keras_boost.config import DEFAULTS
from keras_boost.core.adapter import OptimizerAdapter
from keras_boost.stages.freeze.groups import FreezePlan, _branch, _check_groups, resolve_paths, split_parameters_groups
from keras_boost.stages.freeze.sequence import (_check_freeze_p, _check_indices, _check_seed, _check_strategy,
                                                 _strategy_array, generate_freeze_index_sequence, round_robin)

class _Groups:
    """The groups and strategy of a FreezeOpt, kept out of Keras' variable tracking.

    (A list of model variables set on a Keras optimizer would be tracked as optimizer
    variables, and saved and counted as such.)
    """

    def __init__(self, groups, strategy, paths=None):
        self.groups = groups
        self.strategy = strategy
        self.paths = paths  # groups by variable path, from a saved config, resolved at build


@keras.saving.register_keras_serializable(package="keras_boost")
class FreezeOpt(OptimizerAdapter):
    """An optimizer that trains one freeze group per step: MindSpore's `FreezeOpt`.

    A Keras optimizer wrapper (like `keras.optimizers.LossScaleOptimizer`): it is accepted
    wherever an optimizer is.

    - `BoostModel.compile(optimizer=FreezeOpt(...))`, `BoostTrainOneStep(model, FreezeOpt(...))`
      and `compile(gradient_freeze=FreezeOpt(...))`: the boost step unwraps it into its
      freeze stage, which computes the gradients of the step's group only (no backward
      pass through the frozen prefix).
    - `keras.Model.compile(optimizer=FreezeOpt(...))` (any Keras model): `apply` applies
      the gradients of the step's group only and advances the sequence, so the schedule
      is the same; the backward pass of the frozen prefix is computed and dropped.

    MindSpore's `FreezeOpt` builds one sub-optimizer per group, each with its own momentum
    buffers and step counter. keras_boost keeps the single Keras optimizer given here, so
    every variable has one optimizer state and the learning-rate schedule counts global
    steps whichever group a step trains.

    Args:
        opt: the `keras.optimizers.Optimizer` that applies every update.
        train_parameter_groups: list or tuple of lists/tuples of Keras variables, one per
            group. Defaults to `None`: a single group of all trainable variables.
        train_strategy: the group index per step: a list or tuple of ints, or a 1-D
            integer NumPy array or tensor, each in `[0, len(train_parameter_groups))`.
            Defaults to `None`: round-robin over the groups. Needs
            `train_parameter_groups`.
        name: the optimizer's name.

    Attributes:
        optimizer: the wrapped Keras optimizer (also `inner_optimizer`).
        groups: a list of variable lists, or `None`.
        strategy: a 1-D `np.int32` array, or `None` (round-robin).

    Example:

    >>> groups = split_parameters_groups(model, 4)
    >>> sequence = generate_freeze_index_sequence(4, 1, 0.7, 1000)
    >>> freeze_opt = FreezeOpt(keras.optimizers.SGD(0.1), groups, sequence)
    >>> model.compile(optimizer=freeze_opt, loss="mse")
    """

    # The boost step unwraps it into its freeze stage (`registry.unwrap_optimizer`).
    boost_option = "gradient_freeze"
    boost_option_what = "freeze groups"
    unwraps_into_step = True

    def __init__(self, opt, train_parameter_groups=None, train_strategy=None, name=None, **kwargs):
        if isinstance(opt, FreezeOpt):
            raise TypeError("`opt` must not be a FreezeOpt itself: pass the optimizer it wraps.")
        if train_strategy is not None and train_parameter_groups is None:
            raise ValueError(
                "`train_strategy` was given without `train_parameter_groups`: pass the groups "
                "it indexes."
            )
        paths = kwargs.pop("_group_paths", None)
        groups = None
        if paths is None and train_parameter_groups is not None:
            groups = _check_groups(train_parameter_groups)
        strategy = None
        if train_strategy is not None:
            strategy = _strategy_array(train_strategy, "train_strategy")
            if not len(strategy):
                raise ValueError("`train_strategy` must hold at least one group index, got none.")
            _check_indices(strategy, len(paths if paths is not None else groups), "train_strategy")
        super().__init__(opt, name=name or "freeze_opt", argument="opt", **kwargs)
        self._freeze = _Groups(groups, strategy, paths)
        self._selected = None

    # ------------------------------------------------------------ attributes
    @property
    def groups(self):
        return self._freeze.groups

    @property
    def strategy(self):
        return self._freeze.strategy

    # -------------------------------------------------------------- apply
    def build(self, var_list):
        if self._freeze.paths is not None:  # saved groups: indices into the variables it is built on, or paths
            self._freeze.groups = resolve_paths(self._freeze.paths, var_list, "FreezeOpt: the saved groups")
            self._freeze.paths = None
        super().build(var_list)
        self.position = self.add_variable((), initializer="zeros", dtype="int64", name="freeze_position")

    def _schedule(self):
        return self.strategy if self.strategy is not None else round_robin(len(self.groups))

    def apply(self, grads, trainable_variables=None):
        """Applies the gradients of the current group's variables only, then advances the sequence."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if self.groups is None or len(self.groups) == 1:
            allowed = None if self.groups is None else {id(v) for v in self.groups[0]}
            chosen = [(g, v) for g, v in pairs if allowed is None or id(v) in allowed]
            self.inner_optimizer.apply([g for g, _ in chosen], [v for _, v in chosen])
            return
        schedule = self._schedule()
        group = tf.gather(tf.constant(schedule, tf.int32), self.position.value)

        def branch(members):
            allowed = {id(v) for v in members}
            chosen = [(g, v) for g, v in pairs if id(v) in allowed]

            def run():
                if chosen:
                    self.inner_optimizer.apply([tf.identity(g) for g, _ in chosen], [v for _, v in chosen])
                return tf.constant(0)

            return run

        branches = [branch(members) for members in self.groups]
        if tf.inside_function():
            tf.switch_case(group, branches)
        else:
            branches[int(group)]()
        self.position.assign((self.position.value + 1) % len(schedule))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise RuntimeError("FreezeOpt runs only with the TensorFlow backend's stateful apply (keras_boost supports "
                           "TensorFlow only), not with a stateless (JAX-style) apply")

    # ------------------------------------------------------------- config
    def get_config(self):
        groups = self._freeze.paths
        if groups is None and self.groups is not None:
            # Indices into the variables it was built on survive renaming on load; paths otherwise.
            built = {id(v): i for i, v in enumerate(self._trainable_variables)} if self.built else {}
            groups = [[built.get(id(v), v.path) for v in group] for group in self.groups]
        return {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "groups": groups, "strategy": None if self.strategy is None else [int(i) for i in self.strategy]}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        groups = config.pop("groups", None)
        strategy = config.pop("strategy", None)
        return cls(inner, groups, strategy, _group_paths=groups, **config)


def freeze_cell(model, freeze_opt):
    """Builds the per-group plan of a freeze train step.

    MindSpore's `freeze_cell(reducer_flag, network, optimizer, sens, grad,
    use_grad_accumulation, mean, degree, max_accumulation_step)` builds one train cell per
    sub-optimizer. Here the boost train step builds one compiled branch per group from the
    returned plan and takes the rest from its own stages: `network` is `model`,
    `optimizer` is `freeze_opt`; the gradient op (`grad`) is the step's tape, `sens` its
    loss scale, `reducer_flag`/`mean`/`degree` its Horovod allreduce (of the group's
    gradients only), `use_grad_accumulation`/`max_accumulation_step` its accumulation
    stage. (MindSpore's freeze cell references a missing attribute when accumulation is
    on; the boost step does not share that defect.)

    Args:
        model: the built `keras.Model` being trained.
        freeze_opt: a `FreezeOpt`. Groups `None` mean one group of all trainable
            variables; strategy `None` means round-robin over the groups.

    Returns:
        A `FreezePlan`.

    Example:

    >>> plan = freeze_cell(model, freeze_opt)
    >>> plan.branches[plan.group_at(0)].variables
    """
    if not isinstance(freeze_opt, FreezeOpt):
        raise TypeError(f"`freeze_opt` must be a FreezeOpt, got {type(freeze_opt).__name__}.")
    trainable = model.trainable_variables
    positions = {id(v): i for i, v in enumerate(trainable)}
    groups = [list(trainable)] if freeze_opt.groups is None else freeze_opt.groups
    branches = tuple(_branch(group, positions, i) for i, group in enumerate(groups))
    schedule = freeze_opt.strategy if freeze_opt.strategy is not None else round_robin(len(branches))
    return FreezePlan(branches, schedule)


_DEFAULT = DEFAULTS["grad_freeze"]  # keras_boost's freeze defaults live in config.py only


class GradientFreeze:
    """Gradient freezing: trains a deep suffix of the network on a share of the steps.

    Splits the trainable variables into `param_groups` nested groups and generates the
    group sequence; the boost train step then trains group `sequence[step]` at each step.

    Every argument left out takes keras_boost's default from
    `keras_boost.config.DEFAULTS["grad_freeze"]`, the one place those defaults live (the
    values below are the ones it holds).

    Args:
        param_groups: int (>= 1), the number of groups `G`. Defaults to 4 (MindSpore's
            AutoBoost: 10).
        freeze_type: int, 0 (continuous, "00001234") or 1 (interval, "01020304").
            Defaults to 0 (MindSpore's AutoBoost: 1). keras_boost's defaults are the
            AutoBoost O1/O2 defaults, chosen from measurements (docs/auto_boost.md, "O1's
            defaults"); MindSpore's `GradientFreeze` has none, so a port that passes all
            four arguments gets the same sequence as MindSpore.
        freeze_p: float in (0, 1], the share of FULL (unfrozen) steps despite its name.
            Defaults to 0.7.
        total_steps: int (>= 1), the planned number of training steps (a float with an
            integral value, MindSpore's `2000.0`, is accepted). Defaults to 65536.
        seed: int in [0, 2**32), the seed of the interval sampling; the same on every
            worker. Defaults to 0.

    Example:

    >>> freeze = GradientFreeze(param_groups=4, freeze_p=0.7, total_steps=1000)
    >>> model, freeze_opt = freeze.freeze_generate(model, keras.optimizers.SGD(0.1))
    """

    def __init__(self, param_groups=_DEFAULT["param_groups"], freeze_type=_DEFAULT["freeze_type"],
                 freeze_p=_DEFAULT["freeze_p"], total_steps=_DEFAULT["total_steps"], seed=_DEFAULT["seed"]):
        self.param_groups = check_int("param_groups", param_groups, 1)
        self.freeze_type = _check_strategy(freeze_type, "freeze_type")
        self.freeze_p = _check_freeze_p(freeze_p)
        self.total_steps = check_steps("total_steps", total_steps)
        self.seed = _check_seed(seed)

    def split_parameters_groups(self, model, freeze_para_groups_number=None):
        """`split_parameters_groups` with `param_groups` groups unless given."""
        if freeze_para_groups_number is None:
            freeze_para_groups_number = self.param_groups
        return split_parameters_groups(model, freeze_para_groups_number)

    def generate_freeze_index_sequence(
        self, parameter_groups_number=None, freeze_strategy=None, freeze_p=None, total_steps=None
    ):
        """`generate_freeze_index_sequence`; arguments not given come from this object."""
        return generate_freeze_index_sequence(
            self.param_groups if parameter_groups_number is None else parameter_groups_number,
            self.freeze_type if freeze_strategy is None else freeze_strategy,
            self.freeze_p if freeze_p is None else freeze_p,
            self.total_steps if total_steps is None else total_steps,
            self.seed,
        )

    def freeze_generate(self, model, optimizer):
        """Returns `(model, FreezeOpt(optimizer, groups, sequence))`; the model is unchanged."""
        groups = self.split_parameters_groups(model)
        sequence = self.generate_freeze_index_sequence()
        return model, FreezeOpt(optimizer, groups, sequence)

    def get_config(self):
        return {
            "param_groups": self.param_groups,
            "freeze_type": self.freeze_type,
            "freeze_p": self.freeze_p,
            "total_steps": self.total_steps,
            "seed": self.seed,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)
