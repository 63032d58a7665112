"""The boost step: the stage contract, the loop over its hook points, the state store, the registry.

Write your own stage by subclassing `Stage`, overriding the hooks it needs, and registering
it (`registry.register(MyStage)`); `BoostModel.compile(my_option=...)` then makes it.
"""

from keras_boost.step import registry
from keras_boost.core.contract import HOOKS, Stage, StepContext, Window

__all__ = ["HOOKS", "Stage", "StepContext", "Window", "registry"]
