"""AutoBoost: MindSpore's boost-level object and its `network_auto_process_*` flows.

The levels, modes and configuration schema are `keras_boost.config.BoostConfig`;
`AutoBoost` adds MindSpore's processing methods on top of it. `BoostModel(...,
boost_level=..., boost_config=...)` uses the same configuration without this module.
"""

import keras

from keras_boost.compat.params import OptimizerProcess
from keras_boost.config import DEFAULTS, FEATURES, LEVELS, MODES, BoostConfig, read_config  # noqa: F401
from keras_boost.graph.less_bn import LessBN
from keras_boost.model import BoostModel
from keras_boost.step import registry


class AutoBoost(BoostConfig):
    """Turns a boost level and a configuration into the boost of a Keras model.

    Args:
        level: "O0", "O1" or "O2". Default "O0".
        boost_config: a dict or the path of a JSON file (see `keras_boost.config`), or None.

    Example:
        >>> auto = keras_boost.AutoBoost("O1", {"grad_freeze": {"total_steps": 5000}})
        >>> model, optimizer = auto.network_auto_process_train(model, optimizer)
        >>> model.compile(optimizer=optimizer, loss=...)
    """

    def __init__(self, level="O0", boost_config=None):
        super().__init__(level, boost_config)
        registry.validate_level(self)

    # ----------------------------------------------------------- processing
    def network_auto_process_train(self, model, optimizer):
        """Returns `(model, optimizer)` ready for `compile`: LessBN applied when on, stages attached.

        The returned model is a `BoostModel` carrying this AutoBoost; its `compile` turns
        on gradient centralization, freezing, AdaSum and accumulation as configured.
        """

        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
        model = self.rewrite(model, fn_flag=self.params["less_bn"]["fn_flag"])
        if self.features["less_bn"]:
            optimizer = OptimizerProcess(optimizer).generate_new_optimizer()
        model.auto_boost = self
        return model, optimizer

    def network_auto_process_eval(self, model):
        """The model to evaluate with: LessBN-rewritten (without FN) unless it already is."""
        if self.features["less_bn"] and getattr(model, "less_bn_report", None) is None:
            return self.rewrite(model, fn_flag=False)
        return model

    def rewrite(self, model, fn_flag):
        """LessBN of `model` when less_bn is on, as a BoostModel; the input model is unchanged."""
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        if self.features["less_bn"]:
            model = LessBN(model, fn_flag=fn_flag)
        if not isinstance(model, BoostModel):
            report = getattr(model, "less_bn_report", None)
            model = BoostModel(model.inputs, model.outputs, name=model.name)
            model.less_bn_report = report
        return model

    def compile_options(self, model=None):
        """The `BoostModel.compile` stage options this AutoBoost switches on (see the registry)."""
        return registry.level_options(self)

