"""AutoBoost: MindSpore's boost-level object and its `network_auto_process_*` flows.

The levels, modes and configuration schema are `keras_boost.config.BoostConfig`;
`AutoBoost` adds MindSpore's processing methods on top of it. `BoostModel(...,
boost_level=..., boost_config=...)` uses the same configuration without this module.
"""


import keras

from keras_boost import _warnings
from keras_boost.mindspore.params import OptimizerProcess
from keras_boost.config import DEFAULTS, FEATURES, LEVELS, MODES, BoostConfig, read_config  # noqa: F401
from keras_boost.graph.less_bn import LessBN, has_dense_head, keep_output_names
from keras_boost import _keras_compat
from keras_boost._keras_compat import Functional
from keras_boost._validation import alias
from keras_boost.model import BoostModel
from keras_boost.step import registry


class AutoBoost(BoostConfig):
    """Turns a boost level and a configuration into the boost of a Keras model.

    Args:
        level: "O0", "O1" or "O2". Default "O0".
        boost_config: a dict or the path of a JSON file (see `keras_boost.config`), or None.
            `boost_config_dict=` (MindSpore's keyword) is accepted as an alias.

    Example:
        >>> auto = keras_boost.AutoBoost("O1", {"grad_freeze": {"total_steps": 5000}})
        >>> model, optimizer = auto.network_auto_process_train(model, optimizer)
        >>> model.compile(optimizer=optimizer, loss=...)
    """

    def __init__(self, level="O0", boost_config=None, *, boost_config_dict=None):
        super().__init__(level, alias("boost_config", boost_config, "boost_config_dict", boost_config_dict))
        registry.validate_level(self)

    # ----------------------------------------------------------- processing
    def network_auto_process_train(self, model, optimizer):
        """Returns `(model, optimizer)` ready for `compile`: LessBN applied when on, stages attached.

        The returned model is a `BoostModel` carrying this AutoBoost; its `compile` turns
        on gradient centralization, freezing, AdaSum and accumulation as configured.

        - The optimizer returned is the user's own object (its learning-rate schedule,
          custom or not, and its `exclude_from_weight_decay` are kept); only an optimizer
          already built on other variables is replaced by a copy from its config, with a
          warning. A `FreezeOpt` is accepted too.
        - A subclassed model is wrapped in a `BoostModel` that calls it (same variables);
          LessBN needs a functional or Sequential model, so a level with less_bn on
          refuses a subclassed one with a `TypeError`.
        - LessBN as `BoostModel(inputs, outputs, boost_level=...)` applies it: BatchNorms are
          removed only when every output comes from a classifier Dense, which gets the FN
          head. With the `less_bn` section given (MindSpore's LessBN), every Dense output
          gets it, and with `fn_flag` on and no Dense layer producing the output the FN
          head is skipped with a warning (LessBN still applies).
        - Calling it again with the same model (or with the model it returned) returns
          the same processed model: the weights are not copied a second time.
        """
        from keras_boost.stages.freeze import FreezeOpt

        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
        processed = self._processed_model(model)
        if processed is None:
            processed = self.rewrite(model, fn_flag=self.params["less_bn"]["fn_flag"])
            processed.auto_boost = self
            self._processed.append((model, processed))
        if self.features["less_bn"] and processed is not model and not isinstance(optimizer, FreezeOpt):
            optimizer = OptimizerProcess(optimizer).generate_new_optimizer()
        return processed, optimizer

    def network_auto_process_eval(self, model):
        """The model to evaluate with, sharing its variables with the trained one.

        MindSpore's eval network shares its parameters with the training network. Here
        the model given to (or returned by) `network_auto_process_train` gives the
        processed training model itself: the trained variables, FN head included. Any
        other model is LessBN-rewritten (without FN) when less_bn is on, as a copy with
        its own weights, with a warning.
        """
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        processed = self._processed_model(model)
        if processed is not None:
            return processed
        if self.features["less_bn"] and getattr(model, "less_bn_report", None) is None:
            _warnings.warn(f"network_auto_process_eval: {model.name!r} was not processed by this AutoBoost's "
                           "network_auto_process_train, so its LessBN copy has its own weights (those of "
                           f"{model.name!r} now), not trained ones; pass the model given to or returned by "
                           "network_auto_process_train to evaluate the trained weights", UserWarning)
            return self.rewrite(model, fn_flag=False)
        return model

    def _processed_model(self, model):
        """The processed model for `model` (an input or an output of network_auto_process_train), or None."""
        processed = getattr(self, "_processed", None)
        if processed is None:
            processed = self._processed = []
        for original, result in processed:
            if model is original or model is result:
                return result
        weights = {id(v) for v in model.weights}
        for original, result in processed:  # another model over the same layers (e.g. keras.Model(inp, out))
            if weights and weights == {id(v) for v in original.weights}:
                return result
        return None

    def rewrite(self, model, fn_flag):
        """LessBN of `model` when less_bn is on, as a BoostModel; the input model is unchanged."""
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        functional = isinstance(model, (Functional, keras.Sequential))
        if self.features["less_bn"] and getattr(model, "less_bn_report", None) is None:
            if not functional:
                raise TypeError(f"level {self.level} rewrites the layer graph (LessBN), which needs a functional or "
                                f"Sequential model; {model.name!r} is a subclassed {type(model).__name__}. Build it "
                                "functionally, or switch less_bn off (mode 'manual', 'less_bn': False)")
            if fn_flag and not has_dense_head(model) and not self.measured("less_bn"):
                _warnings.warn(f"fn_flag: {model.name!r} has no Dense layer producing its output, so the FN head is "
                               "skipped; LessBN still applies", UserWarning)
                fn_flag = False
            model = LessBN(model, fn_flag=fn_flag, fn_needs_removal=self.measured("less_bn"),
                           fn_outputs="classifiers" if self.measured("less_bn") else "all")
        if isinstance(model, BoostModel):
            return model
        report = getattr(model, "less_bn_report", None)
        if functional:
            inputs, outputs = (_keras_compat.functional_structure(model) if isinstance(model, Functional)
                               else (model.inputs, model.outputs))  # a dict of outputs stays a dict
            source, model = model, BoostModel(inputs, outputs, name=model.name)
            keep_output_names(source, model)
        else:
            model = _BoostWrapper(model)
        model.less_bn_report = report
        return model

    def compile_options(self, model=None):
        """The `BoostModel.compile` stage options this AutoBoost switches on (see the registry)."""
        return registry.level_options(self)



class _BoostWrapper(BoostModel):
    """A BoostModel that calls a subclassed Keras model: its variables are the model's own."""

    def __init__(self, model, **kwargs):
        kwargs.setdefault("name", f"{model.name}_boost")
        super().__init__(**kwargs)
        self.model = model
        if model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)
