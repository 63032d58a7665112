"""Boost levels O0/O1/O2, modes and the configuration schema (no TensorFlow, no Horovod).

`BoostConfig` is the value behind MindSpore's `AutoBoost(level, kwargs)`, without its defects: each AutoBoost is its own
value (no process-wide singleton), an unknown level, mode, section or key raises
`ValueError` listing the valid ones, values are validated when the AutoBoost is made,
and AdaSum really runs in O2 (together with freezing).

Levels:
    O0: nothing.  O1: LessBN + FN head + gradient centralization + gradient freezing.
    O2: O1 + AdaSum + an exponential moving average of the weights (keras_boost's).

Configuration (a dict, or the path of a JSON file), with MindSpore's sections and keys:

    {"boost": {"mode": "auto" | "manual" | "enable_all" | "disable_all",
               "less_bn": bool, "grad_freeze": bool, "adasum": bool, "grad_accumulation": bool,
               "measure": bool, "fused_update": bool, "fused_batchnorm": bool,
               "conv_matmul": bool, "ema": bool},
     "common": {"gradient_split_groups": None | [int, ...], "device_number": None | int},
     "less_bn": {"fn_flag": True, "gc_flag": True},
     "grad_freeze": {"param_groups": 4, "freeze_type": 0, "freeze_p": 0.7,
                     "total_steps": 65536, "seed": 0},
     "grad_accumulation": {"grad_accumulation_step": 1},
     "adasum": {"backend": "auto"},
     "dim_reduce": {"rho": 0.55, "gamma": 0.9, "alpha": 0.001, "sigma": 0.4, "n_components": 32,
                    "pca_mat_path": None, "weight_load_dir": None, "timeout": 1800}}

The freezing defaults differ from MindSpore's, chosen from measurements
(docs/auto_boost.md, "O1's defaults"): freezing uses the continuous strategy over 4 groups (`freeze_type` 0,
`param_groups` 4; MindSpore: the interval strategy over 10 groups). `MINDSPORE_DEFAULTS`
is MindSpore's values of the `less_bn` and `grad_freeze` sections, to pass as (or merge
into) the configuration: `AutoBoost("O1", MINDSPORE_DEFAULTS)` is MindSpore's O1 exactly.

Self-measurement (keras_boost's, not MindSpore's; `"boost": {"measure": True}` by default): the
level's gradient freezing and gradient centralization time themselves during the first
steps of `fit` and are switched off, with one printed line giving the numbers, where they
do not pay on this model and launch (`keras_boost.step.tuning`). A feature whose section
the configuration gives (`"grad_freeze": {...}`, `"less_bn": {...}`) keeps what it says, so
`MINDSPORE_DEFAULTS` is MindSpore's fixed O1; `"measure": False` fixes every feature.

Fused update (keras_boost's; `"boost": {"fused_update": True}` by default wherever the level
or mode switches a feature on): Keras' SGD/Adam/AdamW update runs as TensorFlow's fused
training kernels (`keras_boost.stages.fused_update`), as MindSpore's optimizers are kernels.
Fused BatchNorm (keras_boost's; `"boost": {"fused_batchnorm": True}` by default in the same
cases): Keras' `BatchNormalization` layers train through TensorFlow's fused kernel inside
the step (`keras_boost.stages.fused_batchnorm`), as MindSpore's `BatchNorm` is one kernel.
One-pixel convolutions as matrix products (keras_boost's; `"boost": {"conv_matmul": True}` by
default in the same cases): a convolution whose output is one pixel (an ImageNet network's last
stages on 32x32 images) runs inside the step as one matrix product
(`keras_boost.stages.conv_matmul`).
Weight averaging (keras_boost's, Composer's EMA; `"boost": {"ema": True}` by default at O2):
the step keeps an exponential moving average of the trainable weights, which validation,
the epoch-end callbacks and the model after `fit` use (`keras_boost.stages.ema`).

MindSpore's own documented configuration is accepted as it is: every section and key
MindSpore reads is a valid key here. Its `dim_reduce` section (and the `dim_reduce` and
`loss_scale_group` switches) are accepted and kept, and raise `ValueError` only when the
feature is switched on, since keras_boost does not provide it. Keys MindSpore does not
read (the tutorial's `device_num`, `n_component`) still raise: nothing is silently ignored.

Feature switches in "boost" take effect in "manual" mode only; in other modes they are
ignored, as in MindSpore, with a warning naming each one that differs from what the level
or mode decides. A section's values are validated always and used
when its feature is on. MindSpore's `dim_reduce` and `loss_scale_group` are not provided
by keras_boost: switching them on raises `ValueError`. `enable_all` switches on the
features keras_boost provides (MindSpore's also switches on those two).
"""

import copy
import json
import os

from keras_boost._warnings import warn
from keras_boost._validation import check_bool

FEATURES = ("less_bn", "grad_freeze", "adasum", "grad_accumulation")
UNSUPPORTED_FEATURES = ("dim_reduce", "loss_scale_group")
LEVELS = {
    "O0": dict.fromkeys(FEATURES, False),
    "O1": {"less_bn": True, "grad_freeze": True, "adasum": False, "grad_accumulation": False},
    "O2": {"less_bn": True, "grad_freeze": True, "adasum": True, "grad_accumulation": False},
}
EMA_LEVELS = ("O2",)  # the levels whose models evaluate and end with the weights' moving average (stages/ema.py)
MODES = ("auto", "manual", "enable_all", "disable_all")
DEFAULTS = {
    "common": {"gradient_split_groups": None, "device_number": None},
    "less_bn": {"fn_flag": True, "gc_flag": True},
    # keras_boost's freezing default: the continuous strategy over 4 groups (MindSpore's
    # interval strategy over 10 groups mostly draws shallow groups, which save little, and
    # compiles a step per group as each is first drawn, scattered over the run); see
    # docs/auto_boost.md, "O1's defaults".
    "grad_freeze": {"param_groups": 4, "freeze_type": 0, "freeze_p": 0.7, "total_steps": 65536, "seed": 0},
    "grad_accumulation": {"grad_accumulation_step": 1},
    "adasum": {"backend": "auto"},
    # MindSpore's DimReduce hyper-parameters: accepted (so MindSpore's documented config
    # loads), never used; switching dim_reduce on raises ValueError.
    "dim_reduce": {"rho": 0.55, "gamma": 0.9, "alpha": 0.001, "sigma": 0.4, "n_components": 32,
                   "pca_mat_path": None, "weight_load_dir": None, "timeout": 1800},
}
SECTIONS = ("boost", *DEFAULTS)
# MindSpore's documented values where keras_boost's defaults differ: pass it as the
# configuration (or merge it into yours) for MindSpore's exact O1/O2.
MINDSPORE_DEFAULTS = {
    "less_bn": {"fn_flag": True, "gc_flag": True},
    "grad_freeze": {"param_groups": 10, "freeze_type": 1, "freeze_p": 0.7, "total_steps": 65536},
}


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


_check_bool = check_bool


_BOOST_OPTIONS = ("mode", "measure", "fused_update", "fused_batchnorm", "conv_matmul", "ema")  # the "boost" keys that are no feature switch


class BoostConfig:
    """A boost level and its configuration, validated (the value behind `AutoBoost`).

    Args:
        level: "O0", "O1" or "O2". Default "O0".
        boost_config: a dict or the path of a JSON file (see the module docstring), or None.

    Attributes:
        level, mode: as given (mode defaults to "auto").
        features: {feature: bool} for "less_bn", "grad_freeze", "adasum", "grad_accumulation".
        explicit: the features switched on by name (manual mode, `"adasum": True`), as
            opposed to by the level or mode; an explicit AdaSum whose `device_number`
            does not fit the launch is an error, a level's one is turned off with a warning.
        params: every section with its defaults filled in.
        measure: whether the level's freezing and centralization measure themselves in
            `fit` (see `measured`).
        fused_update: whether the step applies the optimizer's update with TensorFlow's fused
            kernels (default: whether any feature is on).
        fused_batchnorm: whether the step's forward pass trains the BatchNormalization layers
            with TensorFlow's fused kernel (default: whether any feature is on).
        conv_matmul: whether the step's forward pass computes the convolutions whose output
            is one pixel as matrix products (default: whether any feature is on).
        ema: whether the model keeps an exponential moving average of its weights, which
            validation and the model after `fit` use (`keras_boost.stages.ema`; default: at O2).

    The schema (sections, keys, switches) is checked here; the values of each feature are
    checked by the stage they configure (`keras_boost.step.registry.validate_level`), which
    `BoostModel` and `AutoBoost` call at construction.
    """

    def __init__(self, level="O0", boost_config=None):
        if level not in LEVELS:
            raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
        self.level = level
        config = read_config(boost_config)
        _check_keys("<top level>", config, SECTIONS)
        boost = config.get("boost", {})
        _check_keys("boost", boost, (*_BOOST_OPTIONS, *FEATURES, *UNSUPPORTED_FEATURES))
        self.mode = boost.get("mode", "auto")
        self.measure = _check_bool("boost_config['boost']['measure']", boost.get("measure", True))
        if self.mode not in MODES:
            raise ValueError(f"The boost mode must be in {list(MODES)}, but got {self.mode!r}")
        self.features = self._features(boost)
        self.fused_update = _check_bool("boost_config['boost']['fused_update']",
                                        boost.get("fused_update", any(self.features.values())))
        self.fused_batchnorm = _check_bool("boost_config['boost']['fused_batchnorm']",
                                           boost.get("fused_batchnorm", any(self.features.values())))
        self.conv_matmul = _check_bool("boost_config['boost']['conv_matmul']",
                                       boost.get("conv_matmul", any(self.features.values())))
        self.ema = _check_bool("boost_config['boost']['ema']", boost.get("ema", level in EMA_LEVELS))
        self.params = copy.deepcopy(DEFAULTS)
        for section, defaults in DEFAULTS.items():
            given = config.get(section, {})
            _check_keys(section, given, defaults)
            self.params[section].update(given)
        less_bn = self.params["less_bn"]
        _check_bool("boost_config['less_bn']['fn_flag']", less_bn["fn_flag"])
        _check_bool("boost_config['less_bn']['gc_flag']", less_bn["gc_flag"])
        self.boost_config = config

    def _features(self, boost):
        switches = {k: _check_bool(f"boost_config['boost'][{k!r}]", v) for k, v in boost.items()
                    if k not in _BOOST_OPTIONS}
        enabled_unsupported = [k for k in UNSUPPORTED_FEATURES if switches.get(k)]
        if enabled_unsupported:
            raise ValueError(f"{enabled_unsupported} are MindSpore features that keras_boost does not provide; "
                             f"available features: {list(FEATURES)}")
        feature_switches = {k: v for k, v in switches.items() if k in FEATURES}
        self.explicit = {k for k, v in feature_switches.items() if v} if self.mode == "manual" else set()
        if self.mode == "manual":
            return {**LEVELS[self.level], **feature_switches}
        if self.mode == "enable_all":
            features = dict.fromkeys(FEATURES, True)
        elif self.mode == "disable_all":
            features = dict.fromkeys(FEATURES, False)
        else:
            features = dict(LEVELS[self.level])
        # MindSpore ignores the switches outside manual mode (its documented config lists
        # them all, False, with mode "auto"); keras_boost too, but says so when one differs.
        ignored = sorted(k for k, v in feature_switches.items() if v != features[k])
        if ignored:
            warn(f"feature switches {ignored} in boost_config['boost'] take effect only with mode "
                 f"'manual'; the mode is {self.mode!r}, so level {self.level} decides: "
                 f"{ {k: features[k] for k in ignored} }", UserWarning)
        return features

    def enabled(self, feature):
        return self.features[feature]

    def measured(self, feature):
        """Whether `feature` is on by the level (or mode) and free to be switched off by self-measurement.

        Not when `"measure"` is False, when the feature was switched on by name (manual
        mode), or when the configuration gives the feature's section (its values are then
        the user's choice, as `MINDSPORE_DEFAULTS` gives MindSpore's).
        """
        return (self.measure and self.features[feature] and feature not in self.explicit
                and feature not in self.boost_config)

    def get_config(self):
        return {"level": self.level, "boost_config": copy.deepcopy(self.boost_config)}

    def __repr__(self):
        on = [k for k, v in self.features.items() if v]
        return f"{type(self).__name__}(level={self.level!r}, mode={self.mode!r}, features={on})"
