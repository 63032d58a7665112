"""Gradient freezing: which variables each step trains, and in which order.

MindSpore's `mindspore.boost.grad_freeze`, in Keras form. The trainable variables are cut
into blocks (a kernel layer with the normalisation layers that follow it), and the blocks
into `G` nested groups: group 0 is every variable, group `k` only the blocks from
`k * stride` onward, so the shallow prefix gets no gradient and its backward pass is
skipped. An index sequence says which group each step trains: index 0 (a full step) on a
`freeze_p` share of the steps, a partial group on the rest.

This module is the pure part: the groups, the sequence, the `FreezeOpt` container and the
per-group plan (`freeze_cell`). The boost train step builds one compiled branch per group
from that plan and picks the branch with the sequence. Unlike MindSpore, keras_boost keeps
one optimizer, with one state per variable, for all groups (see `FreezeOpt`).
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from keras_boost import _keras_compat
from keras_boost._validation import check_int, check_real, check_steps
from keras_boost.step.contract import Stage

CONTINUOUS_STRATEGY = 0  # "0000…01234…": zeros, then every partial group in turn
INTERVAL_STRATEGY = 1  # "0 k 0 0 k 0 …": full steps interleaved with sampled groups

# Layers whose variables belong with the kernel layer before them (MindSpore glues
# parameters named 'bn' to the preceding conv). RMSNormalization exists from Keras 3.9.
_NORMALIZATION_LAYERS = tuple(
    getattr(keras.layers, name)
    for name in (
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "RMSNormalization",
    )
    if hasattr(keras.layers, name)
)


_check_int = check_int


def _check_freeze_p(freeze_p):
    return check_real("freeze_p", freeze_p, low=0, low_inclusive=False, high=1,
                      allowed="a number in (0, 1] (the share of full, unfrozen steps)")


def _check_strategy(freeze_strategy, name="freeze_strategy"):
    valid = isinstance(freeze_strategy, (int, np.integer)) and not isinstance(freeze_strategy, bool)
    if not valid or freeze_strategy not in (CONTINUOUS_STRATEGY, INTERVAL_STRATEGY):
        raise ValueError(
            f"Unsupported freezing training strategy {freeze_strategy!r}: `{name}` "
            f"must be {CONTINUOUS_STRATEGY} (continuous) or {INTERVAL_STRATEGY} (interval)."
        )
    return int(freeze_strategy)


def _check_seed(seed):
    return _check_int("seed", seed, 0, 2**32 - 1)


def _sublayers(layer):
    if isinstance(layer, keras.Model):
        return layer.layers  # forward (topological) order for functional models
    return _keras_compat.flatten_layers(layer, include_self=False, recursive=False)


def _walk(layer, seen):
    """Yields `layer` and its sublayers depth-first, each shared layer once."""
    if id(layer) in seen:
        return
    seen.add(id(layer))
    yield layer
    for sublayer in _sublayers(layer):
        yield from _walk(sublayer, seen)


def _layer_units(model):
    """(layer, trainable variables it owns itself) pairs in forward order.

    A variable belongs to the deepest layer that holds it; variables that only the model
    holds (weights added on a subclassed model) come first, as in `trainable_variables`.
    """
    layers = list(_walk(model, set()))
    owner = {}
    for layer in layers:
        for variable in layer.trainable_variables:
            owner[id(variable)] = layer
    units = []
    for layer in layers:
        own = [v for v in layer.trainable_variables if owner[id(v)] is layer]
        if own:
            units.append((layer, own))
    return units


def _blocks(model):
    """Lists of variables: one kernel layer plus the normalisation layers that follow it."""
    blocks, leading = [], []
    for layer, variables in _layer_units(model):
        if not isinstance(layer, _NORMALIZATION_LAYERS):
            blocks.append(leading + variables)
            leading = []
        elif blocks:
            blocks[-1].extend(variables)
        else:
            leading.extend(variables)
    if leading:
        blocks.append(leading)
    return blocks


def split_parameters_groups(model, freeze_para_groups_number):
    """Splits a model's trainable variables into nested freeze groups.

    Blocks are built in forward order: the variables of one layer that owns a kernel
    (Conv, Dense, Embedding, ...) followed by those of the normalisation layers
    (BatchNormalization, LayerNormalization, ...) right after it; normalisation layers
    before the first kernel layer join the first block. With
    `stride = len(blocks) // G`, group `i` is every block from `i * stride` onward, so
    group 0 is all trainable variables and later groups leave a longer shallow prefix
    frozen. When there are fewer blocks than groups (`stride == 0`), every group is all
    trainable variables.

    Args:
        model: a built `keras.Model` (or layer) with trainable variables.
        freeze_para_groups_number: int, the number of groups `G` (>= 1).

    Returns:
        A list of `G` lists of Keras variables.

    Example:

    >>> groups = split_parameters_groups(model, 10)
    >>> len(groups[0]) == len(model.trainable_variables)
    True
    """
    count = _check_int("freeze_para_groups_number", freeze_para_groups_number, 1)
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(
            f"`model` must have trainable variables to split into groups; {model.name!r} has "
            "none (is it built?)."
        )
    stride = len(blocks) // count
    return [sum(blocks[i * stride :], []) for i in range(count)]


def _continuous_sequence(groups, freeze_p, length):
    zeros = int(freeze_p * (groups - 1) // (1 - freeze_p) + 0.5)
    pattern = np.concatenate([np.zeros(zeros, np.int32), np.arange(1, groups, dtype=np.int32)])
    return np.tile(pattern, -(-length // len(pattern)))


def _interval_freeze_steps(freeze_p, length):
    """Boolean mask of the partial steps: keeps the running partial share just below 1-p."""
    partial = np.zeros(length, bool)
    full_count, partial_count = 1, 0
    for step in range(1, length):
        if partial_count / (full_count + partial_count) < 1 - freeze_p:
            partial[step] = True
            partial_count += 1
        else:
            full_count += 1
    return partial


def _interval_sequence(groups, freeze_p, length, seed):
    partial = _interval_freeze_steps(freeze_p, length)
    weights = np.arange(1, groups) / sum(range(1, groups))
    sequence = np.zeros(length, np.int32)
    # Sampling from the reversed indices gives P(k) = (G - k) / (G (G - 1) / 2).
    sequence[partial] = np.random.RandomState(seed).choice(
        np.arange(groups - 1, 0, -1), size=int(partial.sum()), p=weights
    )
    return sequence


def generate_freeze_index_sequence(
    parameter_groups_number, freeze_strategy, freeze_p, total_steps, seed=0
):
    """Generates the group index to train at each step, as MindSpore does.

    Index 0 is a full step (every variable), index `k` trains group `k` only. The length
    is `T = int(total_steps * 1.01)`; the train step wraps around at the end.

    - `G <= 1` or `freeze_p == 1`: `T` zeros (MindSpore divides by zero for
      `freeze_p == 1` with the continuous strategy; here it means "never freeze").
    - Continuous (0): the pattern `[0] * z + [1, ..., G-1]`, with
      `z = int(p * (G - 1) // (1 - p) + 0.5)` (a floating-point floor division: 20 for
      p=0.7, G=10), repeated until the length is at least `T`. As in MindSpore it is not
      truncated, so the length is a whole number of patterns and wrapping around keeps
      the pattern intact.
    - Interval (1): starts with 0, then a partial step whenever the running share of
      partial steps is below `1 - p`, a full step otherwise; each partial step samples
      `k` with probability `(G - k) / (G (G - 1) / 2)`. Length exactly `T`. Sampling uses
      `np.random.RandomState(seed)`, so every worker builds the same sequence, and it
      equals MindSpore's after `np.random.seed(seed)`.

    Args:
        parameter_groups_number: int, the number of groups `G` (>= 1).
        freeze_strategy: int, 0 (continuous) or 1 (interval). Anything else raises
            `ValueError`, even when `G <= 1`.
        freeze_p: float in (0, 1], the share of full (unfrozen) steps. 0 is rejected: it
            would never train the shallow blocks.
        total_steps: int (>= 1), the planned number of training steps.
        seed: int in [0, 2**32), the seed of the interval sampling. Defaults to 0.

    Returns:
        A 1-D `np.int32` array of group indices in `[0, G)`.

    Example:

    >>> generate_freeze_index_sequence(4, 0, 0.5, 10)[:8]
    array([0, 0, 0, 1, 2, 3, 0, 0], dtype=int32)
    """
    groups = _check_int("parameter_groups_number", parameter_groups_number, 1)
    strategy = _check_strategy(freeze_strategy)
    freeze_p = _check_freeze_p(freeze_p)
    length = int(check_steps("total_steps", total_steps) * 1.01)
    seed = _check_seed(seed)
    if groups <= 1 or freeze_p == 1:
        return np.zeros(length, np.int32)
    if strategy == CONTINUOUS_STRATEGY:
        return _continuous_sequence(groups, freeze_p, length)
    return _interval_sequence(groups, freeze_p, length, seed)


def frozen_share(sequence, parameter_groups_number):
    """Estimates the share of block updates a sequence skips.

    Group `k` leaves about `k / G` of the blocks frozen (exactly `k * stride` of them), so
    the estimate is the mean of `k / G` over the steps: about 0.11 for the interval
    strategy and 0.15 for the continuous one with G=10, p=0.7.

    Args:
        sequence: 1-D integer array of group indices, e.g. from
            `generate_freeze_index_sequence`.
        parameter_groups_number: int, the number of groups `G` (>= 1).

    Returns:
        A float in [0, 1).

    Example:

    >>> frozen_share(np.array([0, 0, 1, 3]), 4)
    0.25
    """
    groups = _check_int("parameter_groups_number", parameter_groups_number, 1)
    sequence = _strategy_array(sequence, "sequence")
    _check_indices(sequence, groups, "sequence")
    return float(sequence.mean() / groups) if len(sequence) else 0.0


def _strategy_array(strategy, name):
    """`strategy` as a 1-D np.int32 array; list/tuple of ints, integer array or tensor."""
    if isinstance(strategy, (list, tuple)):
        for element in strategy:
            if isinstance(element, bool) or not isinstance(element, (int, np.integer)):
                raise ValueError(
                    f"Every element of `{name}` must be an int, got {element!r} "
                    f"({type(element).__name__})."
                )
        return np.asarray(strategy, np.int64).astype(np.int32)
    if tf.is_tensor(strategy) or isinstance(strategy, np.ndarray):
        array = np.asarray(strategy)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"`{name}` given as an array or tensor must be 1-D with an integer dtype, got "
                f"shape {array.shape} and dtype {array.dtype}."
            )
        return array.astype(np.int32)
    raise TypeError(
        f"`{name}` must be None, a list or tuple of ints, a NumPy array or a tensor, got "
        f"{type(strategy).__name__}."
    )


def _check_indices(strategy, groups, name):
    bad = np.flatnonzero((strategy < 0) | (strategy >= groups))
    if len(bad):
        raise ValueError(
            f"`{name}` holds group indices in [0, {groups}), got {int(strategy[bad[0]])} at "
            f"position {int(bad[0])}."
        )


def _check_groups(groups):
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            "`train_parameter_groups` must be a list or tuple of variable lists, got "
            f"{type(groups).__name__}."
        )
    if not groups:
        raise ValueError("`train_parameter_groups` must hold at least one group, got none.")
    for index, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            raise TypeError(
                f"Every element of `train_parameter_groups` must be a list or tuple of "
                f"variables; element {index} is a {type(group).__name__}."
            )
        if not group:
            raise ValueError(f"`train_parameter_groups` element {index} is empty.")
        for variable in group:
            if not isinstance(variable, keras.Variable):
                raise TypeError(
                    f"`train_parameter_groups` element {index} must hold Keras variables, got "
                    f"{variable!r} ({type(variable).__name__})."
                )
    return [list(group) for group in groups]


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
class FreezeOpt(keras.optimizers.Optimizer):
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

    def __init__(self, opt, train_parameter_groups=None, train_strategy=None, name=None, **kwargs):
        if not isinstance(opt, keras.optimizers.Optimizer):
            raise TypeError(
                f"`opt` must be a keras.optimizers.Optimizer instance, got {type(opt).__name__}."
            )
        if isinstance(opt, FreezeOpt):
            raise TypeError("`opt` must not be a FreezeOpt itself: pass the optimizer it wraps.")
        if train_strategy is not None and train_parameter_groups is None:
            raise ValueError(
                "`train_strategy` was given without `train_parameter_groups`: pass the groups "
                "it indexes."
            )
        paths = kwargs.pop("_group_paths", None)
        unknown = {k: v for k, v in kwargs.items() if k != "learning_rate"}
        if unknown:
            raise ValueError(f"FreezeOpt takes no optimizer arguments of its own, got {sorted(unknown)}; set them "
                             "on the optimizer it wraps")
        groups = None
        if paths is None and train_parameter_groups is not None:
            groups = _check_groups(train_parameter_groups)
        strategy = None
        if train_strategy is not None:
            strategy = _strategy_array(train_strategy, "train_strategy")
            if not len(strategy):
                raise ValueError("`train_strategy` must hold at least one group index, got none.")
            _check_indices(strategy, len(paths if paths is not None else groups), "train_strategy")
        super().__init__(learning_rate=0.0, name=name or "freeze_opt")
        self.inner_optimizer = opt
        self._freeze = _Groups(groups, strategy, paths)
        self._selected = None

    # ------------------------------------------------------------ attributes
    @property
    def optimizer(self):
        return self.inner_optimizer

    @property
    def groups(self):
        return self._freeze.groups

    @property
    def strategy(self):
        return self._freeze.strategy

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    # -------------------------------------------------------------- apply
    def build(self, var_list):
        if self._freeze.paths is not None:  # saved groups: indices into the variables it is built on, or paths
            var_list = list(var_list)
            by_path = {v.path: v for v in var_list}
            wanted = [p for group in self._freeze.paths for p in group]
            bad = [p for p in wanted if not (p in by_path or (isinstance(p, int) and 0 <= p < len(var_list)))]
            if bad:
                raise ValueError(f"FreezeOpt: the saved groups name variables the model does not have: {bad[:3]}")
            self._freeze.groups = [[var_list[p] if isinstance(p, int) else by_path[p] for p in group]
                                   for group in self._freeze.paths]
            self._freeze.paths = None
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self.position = self.add_variable((), initializer="zeros", dtype="int64", name="freeze_position")

    def _schedule(self):
        if self.strategy is not None:
            return self.strategy
        return np.arange(len(self.groups), dtype=np.int32)

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

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

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


@dataclasses.dataclass(frozen=True)
class FreezeBranch:
    """The variables one freeze group trains.

    Attributes:
        variables: tuple of Keras variables, in group order.
        indices: tuple of their positions in `model.trainable_variables`.
    """

    variables: tuple
    indices: tuple


@dataclasses.dataclass(frozen=True)
class FreezePlan:
    """What the boost train step needs: one branch per group and the group schedule.

    Attributes:
        branches: tuple of `FreezeBranch`, indexed by group.
        schedule: 1-D `np.int32` array, the group of each step; step `s` trains
            `branches[schedule[s % len(schedule)]]`.
    """

    branches: tuple
    schedule: np.ndarray

    @property
    def period(self):
        """Steps after which the schedule wraps around."""
        return len(self.schedule)

    def group_at(self, step):
        """The group trained at (0-based) `step`."""
        return int(self.schedule[step % self.period])


def _branch(group, positions, index):
    missing = [v.path for v in group if id(v) not in positions]
    if missing:
        raise ValueError(
            f"Group {index} of `freeze_opt` holds variables that are not trainable variables "
            f"of `model`: {missing}."
        )
    indices = tuple(positions[id(v)] for v in group)
    if len(set(indices)) != len(indices):
        raise ValueError(f"Group {index} of `freeze_opt` holds a variable more than once.")
    return FreezeBranch(tuple(group), indices)


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
    schedule = freeze_opt.strategy
    if schedule is None:
        schedule = np.arange(len(branches), dtype=np.int32)
    return FreezePlan(branches, schedule)


class GradientFreeze:
    """Gradient freezing: trains a deep suffix of the network on a share of the steps.

    Splits the trainable variables into `param_groups` nested groups and generates the
    group sequence; the boost train step then trains group `sequence[step]` at each step.

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

    def __init__(self, param_groups=4, freeze_type=0, freeze_p=0.7, total_steps=65536, seed=0):
        self.param_groups = _check_int("param_groups", param_groups, 1)
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


class FreezeSchedule(Stage):
    """The gradient-freeze stage of the boost step: which group trains, and where the sequence stands.

    Made from a `GradientFreeze` (groups split from the model when the step is built) or
    a ready `FreezeOpt`. Its position in the sequence is a variable, so a restored run
    continues the same schedule; it advances once per optimizer update (a whole
    accumulation window trains one group) and wraps around at the end of the sequence.
    """

    option = "gradient_freeze"

    def __init__(self, source):
        if not isinstance(source, (GradientFreeze, FreezeOpt, _SavedFreezeOpt)):
            raise TypeError(f"`gradient_freeze` must be a GradientFreeze or a FreezeOpt, got {type(source).__name__}")
        self.source = source
        self.plan = None

    @classmethod
    def from_option(cls, value, model):
        """None, a `GradientFreeze`, a `FreezeOpt` or a ready `FreezeSchedule`."""
        if value is None or isinstance(value, FreezeSchedule):
            return value
        return cls(value)

    def get_config(self):
        if isinstance(self.source, GradientFreeze):
            return {"GradientFreeze": self.source.get_config()}
        groups = [[v.path for v in branch.variables] for branch in self.plan.branches]
        return {"FreezeOpt": {"groups": groups, "strategy": [int(i) for i in self.plan.schedule]}}

    @classmethod
    def from_config(cls, config):
        if "GradientFreeze" in config:
            return cls(GradientFreeze.from_config(config["GradientFreeze"]))
        return cls(_SavedFreezeOpt(**config["FreezeOpt"]))

    def build(self, context):
        state, model, optimizer = context.state, context.model, context.optimizer
        freeze_opt = self.source
        if isinstance(freeze_opt, _SavedFreezeOpt):
            freeze_opt = freeze_opt.resolve(model, optimizer)
        if isinstance(freeze_opt, GradientFreeze):
            _, freeze_opt = freeze_opt.freeze_generate(model, optimizer)
        elif freeze_opt.optimizer is not optimizer:
            # The step applies every update with its own optimizer; a different one here
            # would be silently ignored, with its learning rate and state.
            raise ValueError(
                "The optimizer of `gradient_freeze` (a FreezeOpt) must be the optimizer the "
                f"model is compiled with: got {type(freeze_opt.optimizer).__name__} "
                f"{freeze_opt.optimizer.name!r}, but the model uses {type(optimizer).__name__} "
                f"{optimizer.name!r}. Pass the same instance to compile(optimizer=...)."
            )
        self.plan = freeze_cell(model, freeze_opt)
        self.position = state.add_state("freeze/position", 0, "int64")
        self.last_group = state.add_state("freeze/group", 0, "int32")

    @property
    def group_indices(self):
        """Per group, the indices of its variables in `model.trainable_variables`."""
        return [list(branch.indices) for branch in self.plan.branches]

    def select_branch(self):
        return self.group_indices, self.current_group

    def after_update(self):
        self.advance()

    def upcoming_branch(self):
        """(group, updates): the group of the next update and how many updates in a row train it."""
        schedule, period = self.plan.schedule, self.plan.period
        position = int(self.position.numpy()) % period
        group = int(schedule[position])
        updates = 1
        while updates < period and schedule[(position + updates) % period] == group:
            updates += 1
        return group, updates

    def enter_branch(self, branch):
        """Inside the compiled step of group `branch`: checks the sequence agrees, records the group."""
        expected = tf.gather(tf.constant(self.plan.schedule, tf.int32), self.position.value)
        check = tf.debugging.assert_equal(
            expected, tf.constant(branch, tf.int32),
            message=f"the compiled step of freeze group {branch} ran where the freeze sequence names another group")
        with tf.control_dependencies([check] if check is not None else []):
            self.last_group.assign(tf.constant(branch, tf.int32))

    def current_group(self):
        group = tf.gather(tf.constant(self.plan.schedule, tf.int32), self.position.value)
        self.last_group.assign(group)
        return group

    def advance(self):
        self.position.assign((self.position.value + 1) % self.plan.period)

    def logs(self):
        return {"freeze_group": self.last_group.value}


class _SavedFreezeOpt:
    """A FreezeOpt read back from a saved configuration: groups by variable path, resolved at build."""

    def __init__(self, groups, strategy):
        self.groups = groups
        self.strategy = strategy

    def resolve(self, model, optimizer):
        variables = {v.path: v for v in model.trainable_variables}
        missing = [p for group in self.groups for p in group if p not in variables]
        if missing:
            raise ValueError(f"the saved boost configuration names variables this model does not have: {missing[:3]}")
        return FreezeOpt(optimizer, [[variables[p] for p in group] for group in self.groups], self.strategy)
