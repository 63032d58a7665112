"""keras_boost: MindSpore's boost features for Keras 3 on TensorFlow, distributed with Horovod.

The public surface: `BoostModel`; the stages (`DynamicLossScale`, `FixedLossScale`,
`GradientAccumulation`, `GradientFreeze`, `GradientCentralization`, `AdaSum`,
`GradientCompression`, `HierarchicalAllreduce`); the graph
rewrite (`LessBN`, `FNHead`); MindSpore's names and flows (`AutoBoost`, `FreezeOpt`,
`freeze_cell`, `OptimizerProcess`, `ParameterProcess`, `BoostTrainOneStep`,
`BoostTrainOneStepWithLossScale`); and the modules `distributed`, `callbacks`, `elastic`,
`optimizers` (Keras optimizer wrappers usable with any `keras.Model`), `step` (the stage
contract and registry, for writing your own stage).
"""

import os as _os
import sys as _sys

# The `keras-boost` command (and its horovodrun workers, `python -m keras_boost.app.cli`) must
# not print TensorFlow's C++ start-up lines; TensorFlow reads the level when it is first imported.
_ARGV = list(getattr(_sys, "orig_argv", _sys.argv))
if any(_os.path.basename(a) == "keras-boost" for a in _ARGV[:2]) or "keras_boost.app.cli" in _ARGV[1:3]:
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_boost._startup import import_tensorflow as _import_tensorflow  # noqa: E402

_import_tensorflow()  # checks the TensorFlow version first, and keeps its start-up lines quiet
from keras_boost import _keras_compat  # noqa: E402,F401 - checks the Keras version
from keras_boost import distributed, optimizers, step  # noqa: E402
from keras_boost.mindspore.auto_boost import AutoBoost
from keras_boost.mindspore.params import OptimizerProcess, ParameterProcess
from keras_boost.config import MINDSPORE_DEFAULTS
from keras_boost import callbacks, elastic
from keras_boost.graph.layers import FNHead
from keras_boost.graph.less_bn import LessBN
from keras_boost.model import BoostModel
from keras_boost.stages.centralization import GradientCentralization
from keras_boost.stages.compression import GradientCompression
from keras_boost.stages.freeze import (FreezeOpt, GradientFreeze, freeze_cell, generate_freeze_index_sequence,
                                       split_parameters_groups)
from keras_boost.stages.hierarchical import HierarchicalAllreduce
from keras_boost.stages.loss_scale import DynamicLossScale, FixedLossScale
from keras_boost.mindspore.cells import BoostTrainOneStep, BoostTrainOneStepWithLossScale
from keras_boost.stages.accumulation import GradientAccumulation
from keras_boost.stages.adasum import AdaSum
from keras_boost.core.state import BoostState

from keras_boost._version import __version__  # noqa: E402,F401

__all__ = [
    "AdaSum",
    "AutoBoost",
    "BoostModel",
    "BoostState",
    "BoostTrainOneStep",
    "BoostTrainOneStepWithLossScale",
    "DynamicLossScale",
    "FNHead",
    "FixedLossScale",
    "FreezeOpt",
    "GradientAccumulation",
    "GradientCentralization",
    "GradientCompression",
    "GradientFreeze",
    "HierarchicalAllreduce",
    "LessBN",
    "MINDSPORE_DEFAULTS",
    "OptimizerProcess",
    "ParameterProcess",
    "callbacks",
    "distributed",
    "elastic",
    "freeze_cell",
    "generate_freeze_index_sequence",
    "optimizers",
    "split_parameters_groups",
    "step",
]
