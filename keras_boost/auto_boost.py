"""AutoBoost: boost levels O0/O1/O2, modes and the configuration schema.

The seed's `AutoBoost(level, kwargs)` without its defects: each AutoBoost is its own
value (no process-wide singleton), an unknown level, mode, section or key raises
`ValueError` listing the valid ones, values are validated when the AutoBoost is made,
and AdaSum really runs in O2 (together with freezing).

Levels:
    O0: nothing.  O1: LessBN + FN head + gradient centralization + gradient freezing.
    O2: O1 + AdaSum.

Configuration (a dict, or the path of a JSON file), with MindSpore's sections and keys:

    {"boost": {"mode": "auto" | "manual" | "enable_all" | "disable_all",
               "less_bn": bool, "grad_freeze": bool, "adasum": bool, "grad_accumulation": bool},
     "common": {"gradient_split_groups": None | [int, ...], "device_number": None | int},
     "less_bn": {"fn_flag": True, "gc_flag": True},
     "grad_freeze": {"param_groups": 10, "freeze_type": 1, "freeze_p": 0.7,
                     "total_steps": 65536, "seed": 0},
     "grad_accumulation": {"grad_accumulation_step": 1},
     "adasum": {"backend": "auto"}}

Feature switches in "boost" take effect in "manual" mode only; in other modes they raise
`ValueError` (MindSpore ignores them). A section's values are validated always and used
when its feature is on. MindSpore's `dim_reduce` and `loss_scale_group` are not provided
by keras_boost: switching them on raises `ValueError`.
"""

import copy
import json
import logging
import os

import keras

from keras_boost.adasum import AdaSum
from keras_boost.centralization import gc_variables, GradientCentralization
from keras_boost.freeze import GradientFreeze
from keras_boost.accumulation import GradientAccumulation
from keras_boost.less_bn import LessBN
from keras_boost.step import _check_split_points

logger = logging.getLogger("keras_boost")

FEATURES = ("less_bn", "grad_freeze", "adasum", "grad_accumulation")
UNSUPPORTED_FEATURES = ("dim_reduce", "loss_scale_group")
LEVELS = {
    "O0": dict.fromkeys(FEATURES, False),
    "O1": {"less_bn": True, "grad_freeze": True, "adasum": False, "grad_accumulation": False},
    "O2": {"less_bn": True, "grad_freeze": True, "adasum": True, "grad_accumulation": False},
}
MODES = ("auto", "manual", "enable_all", "disable_all")
DEFAULTS = {
    "common": {"gradient_split_groups": None, "device_number": None},
    "less_bn": {"fn_flag": True, "gc_flag": True},
    "grad_freeze": {"param_groups": 10, "freeze_type": 1, "freeze_p": 0.7, "total_steps": 65536, "seed": 0},
    "grad_accumulation": {"grad_accumulation_step": 1},
    "adasum": {"backend": "auto"},
}
SECTIONS = ("boost", *DEFAULTS)


def read_config(boost_config):
    """A configuration dict from a dict, a JSON file path (read with json.load only) or None."""
    if boost_config is None or boost_config == "":
        return {}
    if isinstance(boost_config, (str, os.PathLike)):
        with open(boost_config) as handle:
            try:
                boost_config = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"boost_config file {os.fspath(boost_config)!r} is not valid JSON: {error}") from None
    if not isinstance(boost_config, dict):
        raise TypeError(f"boost_config must be a dict, a JSON file path or None, got {type(boost_config).__name__}")
    return boost_config


def _check_keys(where, given, valid):
    if not isinstance(given, dict):
        raise TypeError(f"boost_config[{where!r}] must be a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in boost_config[{where!r}]; valid keys: {sorted(valid)}")


def _check_bool(where, value):
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be true or false, got {value!r}")
    return value


class AutoBoost:
    """Turns a boost level and a configuration into the boost of a Keras model.

    Args:
        level: "O0", "O1" or "O2". Default "O0".
        boost_config: a dict or the path of a JSON file (see the module docstring), or None.

    Example:
        >>> auto = keras_boost.AutoBoost("O1", {"grad_freeze": {"total_steps": 5000}})
        >>> model, optimizer = auto.network_auto_process_train(model, optimizer)
        >>> model.compile(optimizer=optimizer, loss=...)
    """

    def __init__(self, level="O0", boost_config=None):
        if level not in LEVELS:
            raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
        self.level = level
        config = read_config(boost_config)
        _check_keys("<top level>", config, SECTIONS)
        boost = config.get("boost", {})
        _check_keys("boost", boost, ("mode", *FEATURES, *UNSUPPORTED_FEATURES))
        self.mode = boost.get("mode", "auto")
        if self.mode not in MODES:
            raise ValueError(f"The boost mode must be in {list(MODES)}, but got {self.mode!r}")
        self.features = self._features(boost)
        self.params = copy.deepcopy(DEFAULTS)
        for section, defaults in DEFAULTS.items():
            given = config.get(section, {})
            _check_keys(section, given, defaults)
            self.params[section].update(given)
        self._validate()
        self.boost_config = config

    def _features(self, boost):
        switches = {k: _check_bool(f"boost_config['boost'][{k!r}]", v) for k, v in boost.items() if k != "mode"}
        enabled_unsupported = [k for k in UNSUPPORTED_FEATURES if switches.get(k)]
        if enabled_unsupported:
            raise ValueError(f"{enabled_unsupported} are MindSpore features that keras_boost does not provide; "
                             f"available features: {list(FEATURES)}")
        feature_switches = {k: v for k, v in switches.items() if k in FEATURES}
        if self.mode == "manual":
            return {**LEVELS[self.level], **feature_switches}
        if feature_switches:
            raise ValueError(f"feature switches {sorted(feature_switches)} in boost_config['boost'] take effect "
                             f"only with mode 'manual'; the mode is {self.mode!r}")
        if self.mode == "enable_all":
            return dict.fromkeys(FEATURES, True)
        if self.mode == "disable_all":
            return dict.fromkeys(FEATURES, False)
        return dict(LEVELS[self.level])

    def _validate(self):
        """Builds every stage once so that bad values fail now, not during training."""
        less_bn = self.params["less_bn"]
        _check_bool("boost_config['less_bn']['fn_flag']", less_bn["fn_flag"])
        _check_bool("boost_config['less_bn']['gc_flag']", less_bn["gc_flag"])
        GradientFreeze(**self.params["grad_freeze"])
        GradientAccumulation(self.params["grad_accumulation"]["grad_accumulation_step"])
        common = self.params["common"]
        AdaSum(device_number=common["device_number"], backend=self.params["adasum"]["backend"])
        _check_split_points(common["gradient_split_groups"])

    def enabled(self, feature):
        return self.features[feature]

    # ----------------------------------------------------------- processing
    def network_auto_process_train(self, model, optimizer):
        """Returns `(model, optimizer)` ready for `compile`: LessBN applied when on, stages attached.

        The returned model is a `BoostModel` carrying this AutoBoost; its `compile` turns
        on gradient centralization, freezing, AdaSum and accumulation as configured.
        """
        from keras_boost.params import OptimizerProcess

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
        from keras_boost.model import BoostModel

        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        if self.features["less_bn"]:
            model = LessBN(model, fn_flag=fn_flag)
        if not isinstance(model, BoostModel):
            report = getattr(model, "less_bn_report", None)
            model = BoostModel(model.inputs, model.outputs, name=model.name)
            model.less_bn_report = report
        return model

    def compile_options(self, model):
        """The `BoostModel.compile` stage options this AutoBoost switches on for `model`."""
        options = {}
        if self.features["less_bn"] and self.params["less_bn"]["gc_flag"]:
            options["gradient_centralization"] = GradientCentralization(gc_variables(model))
        if self.features["grad_freeze"]:
            options["gradient_freeze"] = GradientFreeze(**self.params["grad_freeze"])
        if self.features["adasum"]:
            options["adasum"] = AdaSum(device_number=self.params["common"]["device_number"],
                                       backend=self.params["adasum"]["backend"])
        if self.features["grad_accumulation"]:
            options["gradient_accumulation"] = self.params["grad_accumulation"]["grad_accumulation_step"]
        if self.params["common"]["gradient_split_groups"] is not None:
            options["gradient_split_groups"] = self.params["common"]["gradient_split_groups"]
        return options

    def get_config(self):
        return {"level": self.level, "boost_config": copy.deepcopy(self.boost_config)}

    def __repr__(self):
        on = [k for k, v in self.features.items() if v]
        return f"AutoBoost(level={self.level!r}, mode={self.mode!r}, features={on})"
