"""Gradient freezing: which variables each step trains, and in which order.

MindSpore's `mindspore.boost.grad_freeze`, in Keras form, split by concern:
`groups.py` (the variable groups and the plan the step compiles), `sequence.py` (the group
of each step), `optimizer.py` (MindSpore's forms: `FreezeOpt`, `freeze_cell`,
`GradientFreeze`) and `stage.py` (`FreezeStage`, the boost step's stage).
"""

from keras_boost.stages.freeze.groups import FreezeBranch, FreezePlan, split_parameters_groups
from keras_boost.stages.freeze.optimizer import FreezeOpt, GradientFreeze, freeze_cell
from keras_boost.stages.freeze.sequence import (CONTINUOUS_STRATEGY, INTERVAL_STRATEGY, frozen_share,
                                                 generate_freeze_index_sequence)
from keras_boost.stages.freeze.stage import FreezeStage

__all__ = ["CONTINUOUS_STRATEGY", "INTERVAL_STRATEGY", "FreezeBranch", "FreezeOpt", "FreezePlan",
           "FreezeStage", "GradientFreeze", "freeze_cell", "frozen_share", "generate_freeze_index_sequence",
           "split_parameters_groups"]
