"""The registry: turns `compile` options and boost levels into the stages of a boost step.

One ordered list of stage classes; each class names its `compile` keyword (`option`) and
turns a value of it into a stage (`from_option`). The order of the list is the order in
which stages are built (and so the order of their state variables) and the order in which
the loop calls their hooks. A new stage is one new file plus one `register` line.
"""

import importlib

from keras_boost.step.contract import Stage


class _Entry:
    def __init__(self, cls, unless=()):
        self.cls = cls
        self.unless = tuple(unless)


_ENTRIES = []


def register(cls, unless=(), before=None):
    """Registers a stage class under its `option`; returns the class (usable as a decorator).

    Args:
        cls: a `Stage` subclass with a unique `option`.
        unless: options whose stage, when present, replaces this one (the NaN guard is
            not made when a loss scale decides the skips).
        before: the option of an already registered stage to run before; default: last.
    """
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise TypeError(f"`cls` must be a Stage subclass, got {cls!r}.")
    if not isinstance(cls.option, str) or not cls.option:
        raise ValueError(f"{cls.__name__}.option must name its compile keyword, got {cls.option!r}.")
    unregister(cls.option)
    entry = _Entry(cls, unless)
    positions = [i for i, e in enumerate(_ENTRIES) if e.cls.option == before]
    if before is not None and not positions:
        raise ValueError(f"`before` must be a registered option ({options()}), got {before!r}.")
    _ENTRIES.insert(positions[0] if positions else len(_ENTRIES), entry)
    return cls


def unregister(option):
    _ENTRIES[:] = [e for e in _ENTRIES if e.cls.option != option]


def options():
    """The registered `compile` keywords, in stage order."""
    _ensure_builtin()
    return [e.cls.option for e in _ENTRIES]


def make_stages(values, model):
    """The stages for the given option values (missing options are off), in registry order."""
    _ensure_builtin()
    unknown = sorted(set(values) - set(options()))
    if unknown:
        raise TypeError(f"unknown boost option(s) {unknown}; the registered ones are {options()}")
    made = {}
    for entry in _ENTRIES:
        if any(made.get(option) is not None for option in entry.unless):
            continue
        made[entry.cls.option] = entry.cls.from_option(values.get(entry.cls.option), model)
    return [stage for stage in made.values() if stage is not None]


# ----------------------------------------------------------------- levels
def level_options(boost_config):
    """The compile options a `keras_boost.config.BoostConfig` switches on (no model needed)."""
    from keras_boost.stages.adasum import AdaSum
    from keras_boost.stages.centralization import GradientCentralization
    from keras_boost.stages.freeze import GradientFreeze

    features, params = boost_config.features, boost_config.params
    found = {}
    if features["less_bn"] and params["less_bn"]["gc_flag"]:
        found["gradient_centralization"] = GradientCentralization()
    if features["grad_freeze"]:
        found["gradient_freeze"] = GradientFreeze(**params["grad_freeze"])
    if features["adasum"]:
        # A level's AdaSum (not switched on by name) is turned off, with a warning, when
        # device_number does not fit the launch, as MindSpore does.
        found["adasum"] = AdaSum(device_number=params["common"]["device_number"], backend=params["adasum"]["backend"],
                                 strict="adasum" in getattr(boost_config, "explicit", ()))
    if features["grad_accumulation"]:
        found["gradient_accumulation"] = params["grad_accumulation"]["grad_accumulation_step"]
    if params["common"]["gradient_split_groups"] is not None:
        found["gradient_split_groups"] = params["common"]["gradient_split_groups"]
    return found


def validate_level(boost_config):
    """Makes every stage a configuration describes once, so bad values fail at construction."""
    from keras_boost import _validation
    from keras_boost.stages.accumulation import GradientAccumulation
    from keras_boost.stages.adasum import AdaSum
    from keras_boost.stages.freeze import GradientFreeze

    params = boost_config.params
    GradientFreeze(**params["grad_freeze"])
    GradientAccumulation(params["grad_accumulation"]["grad_accumulation_step"])
    AdaSum(device_number=params["common"]["device_number"], backend=params["adasum"]["backend"])
    _validation.check_split_points(params["common"]["gradient_split_groups"])


# ----------------------------------------------------------------- config
def serialize(stage):
    return {"module": type(stage).__module__, "class_name": type(stage).__name__, "config": stage.get_config()}


def deserialize(config):
    cls = getattr(importlib.import_module(config["module"]), config["class_name"])
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ValueError(f"the saved boost configuration names {config['class_name']!r}, which is not a Stage")
    return cls.from_config(config["config"])


def step_config(step):
    """The options of a compiled step as a JSON-serialisable dict (for `.keras` files)."""
    return {"sens": step.sens, "gradient_split_groups": step.split_points or None,
            "nan_guard": step.nan_guard, "stages": {s.option: serialize(s) for s in step.stages}}


def options_from_config(config):
    """`BoostModel.compile` keyword arguments from `step_config`'s dict."""
    options = {"sens": config.get("sens", 1.0), "gradient_split_groups": config.get("gradient_split_groups"),
               "nan_guard": config.get("nan_guard", True)}
    for option, stage in config.get("stages", {}).items():
        if option != "nan_guard":
            options[option] = deserialize(stage)
    return options


# ---------------------------------------------------------------- builtin
_BUILTIN_LOADED = False


def _ensure_builtin():
    """Registers keras_boost's own stages, in their order, on first use."""
    global _BUILTIN_LOADED
    if _BUILTIN_LOADED:
        return
    _BUILTIN_LOADED = True
    from keras_boost.stages.accumulation import GradientAccumulation
    from keras_boost.stages.adasum import AdaSum
    from keras_boost.stages.centralization import GradientCentralization
    from keras_boost.stages.compression import GradientCompression
    from keras_boost.stages.freeze import FreezeSchedule
    from keras_boost.stages.hierarchical import HierarchicalAllreduce
    from keras_boost.stages.loss_scale import LossScale
    from keras_boost.stages.nan_guard import NonFiniteGuard

    builtin = [_Entry(LossScale), _Entry(NonFiniteGuard, unless=("loss_scale",)), _Entry(GradientAccumulation),
               _Entry(FreezeSchedule), _Entry(GradientCentralization), _Entry(AdaSum),
               _Entry(GradientCompression), _Entry(HierarchicalAllreduce)]
    _ENTRIES[:0] = [e for e in builtin if e.cls.option not in [x.cls.option for x in _ENTRIES]]
