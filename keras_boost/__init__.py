"""keras_boost: MindSpore-style boost features for Keras 3 on TensorFlow, distributed with Horovod."""

import os as _os
import sys as _sys

# The `keras-boost` command (and its horovodrun workers, `python -m keras_boost.cli`) must not
# print TensorFlow's C++ start-up lines; TensorFlow reads the level when it is first imported.
_ARGV = list(getattr(_sys, "orig_argv", _sys.argv))
if any(_os.path.basename(a) == "keras-boost" for a in _ARGV[:2]) or "keras_boost.cli" in _ARGV[1:3]:
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_boost import callbacks, distributed, optimizers
from keras_boost.accumulation import GradientAccumulation
from keras_boost.adasum import AdaSum
from keras_boost.auto_boost import AutoBoost
from keras_boost.centralization import GradientCentralization
from keras_boost.freeze import FreezeOpt, GradientFreeze, freeze_cell, generate_freeze_index_sequence, split_parameters_groups
from keras_boost.layers import FNHead
from keras_boost.less_bn import LessBN
from keras_boost.loss_scale import DynamicLossScale, FixedLossScale
from keras_boost.model import BoostModel
from keras_boost.params import OptimizerProcess, ParameterProcess
from keras_boost.state import BoostState
from keras_boost.step import BoostTrainOneStep, BoostTrainOneStepWithLossScale

__version__ = "0.1.0"

__all__ = [
    "AdaSum",
    "AutoBoost",
    "BoostModel",
    "FNHead",
    "FreezeOpt",
    "GradientCentralization",
    "GradientFreeze",
    "LessBN",
    "OptimizerProcess",
    "ParameterProcess",
    "freeze_cell",
    "generate_freeze_index_sequence",
    "split_parameters_groups",
    "BoostState",
    "BoostTrainOneStep",
    "BoostTrainOneStepWithLossScale",
    "DynamicLossScale",
    "FixedLossScale",
    "GradientAccumulation",
    "callbacks",
    "distributed",
    "optimizers",
]
