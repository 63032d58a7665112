"""Gradient freezing, the groups: which variables each group trains.

MindSpore's `mindspore.boost.grad_freeze` cuts the trainable variables into blocks (a kernel
layer with the normalisation layers that follow it), and the blocks into `G` nested groups:
group 0 is every variable, group `k` only the blocks from `k * stride` onward, so the
shallow prefix gets no gradient and its backward pass is skipped. `FreezePlan` is what the
boost step compiles: one branch (variable indices) per group, and the group sequence.
"""

import dataclasses

import keras
import numpy as np

from keras_boost import _keras_compat
from keras_boost._validation import check_int

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
    count = check_int("freeze_para_groups_number", freeze_para_groups_number, 1)
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(
            f"`model` must have trainable variables to split into groups; {model.name!r} has "
            "none (is it built?)."
        )
    stride = len(blocks) // count
    return [sum(blocks[i * stride :], []) for i in range(count)]


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


def resolve_paths(paths, variables, who):
    """Groups given by variable path (or by index into `variables`) as groups of those variables."""
    variables = list(variables)
    by_path = {v.path: v for v in variables}
    bad = [p for group in paths for p in group
           if not (p in by_path or (isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(variables)))]
    if bad:
        raise ValueError(f"{who} names variables the model does not have: {bad[:3]}")
    return [[variables[p] if isinstance(p, int) else by_path[p] for p in group] for group in paths]


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
