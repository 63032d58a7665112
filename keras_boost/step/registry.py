"""The registry: turns `compile` options and boost levels into the stages of a boost step.

One ordered list of stage classes; each class names its `compile` keyword (`option`) and
turns a value of it into a stage (`from_option`). The order of the list is the order in
which stages are built (and so the order of their state variables) and the order in which
the loop calls their hooks. A new stage is one new file plus one `register` line.
"""

import importlib

from keras_boost.core.contract import Stage


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


def stage_classes():
    """Every registered stage class, the defaults of single hooks last."""
    _ensure_builtin()
    return [e.cls for e in _ENTRIES] + list(_DEFAULTS)


def describe_options(indent="        "):
    """One wrapped paragraph per registered option (its stage's `option_help`), for docstrings."""
    import textwrap

    _ensure_builtin()
    classes = [e.cls for e in _ENTRIES] + [cls for cls in _DEFAULTS if cls.option_help]
    return "\n".join(textwrap.fill(f"{cls.option}: {cls.option_help or 'see ' + cls.__name__}", 100,
                                    initial_indent=indent, subsequent_indent=indent + "    ") for cls in classes)


def make_stages(values, model, extra=(), defaults=None):
    """The stages for the given option values (missing options are off), in registry order.

    `extra`: stages given as objects (`stages=[...]`), run after the registry's. Then, for
    every single hook that no stage owns and a default stage fills (`Stage.default_for`:
    the averaging `reduce`, the optimizer's `apply_update`), that default, made from its
    option in `defaults`.
    """
    _ensure_builtin()
    unknown = sorted(set(values) - set(options()))
    if unknown:
        raise TypeError(f"unknown boost option(s) {unknown}; the registered ones are {options()}")
    made = {}
    for entry in _ENTRIES:
        if any(made.get(option) is not None for option in entry.unless):
            continue
        made[entry.cls.option] = entry.cls.from_option(values.get(entry.cls.option), model)
    stages = [stage for stage in made.values() if stage is not None] + list(extra)
    for cls in _DEFAULTS:
        if not any(stage.overrides(cls.default_for) for stage in stages):
            stages.append(cls.from_option((defaults or {}).get(cls.option), model))
    return stages


def is_default(stage):
    """Whether `stage` is one the registry adds by itself (not saved with the step's options)."""
    return type(stage) in _DEFAULTS


def unwrap_optimizer(optimizer, options):
    """The optimizer that applies the updates, with `options` completed from an optimizer adapter.

    An optimizer adapter of a stage (`FreezeOpt`) names the option it stands for in
    `boost_option`; when `unwraps_into_step` is true, the step runs that stage and the
    adapter's inner `optimizer` applies the updates. `options` is updated in place.
    """
    option = getattr(optimizer, "boost_option", None)
    if option is None or not getattr(optimizer, "unwraps_into_step", False):
        return optimizer
    given = options.get(option)
    if given is not None and given is not optimizer:
        raise ValueError(f"the optimizer is a {type(optimizer).__name__} and `{option}` is given too: pass the "
                         f"{optimizer.boost_option_what} once, either as the optimizer or as {option}")
    options[option] = optimizer
    return optimizer.optimizer


# ----------------------------------------------------------------- levels
def level_options(boost_config):
    """The compile options a `keras_boost.config.BoostConfig` switches on (no model needed).

    Each stage class says what a level means for its option (`Stage.from_level`).
    """
    _ensure_builtin()
    found = {}
    for cls in [e.cls for e in _ENTRIES] + _DEFAULTS:
        value = cls.from_level(boost_config)
        if value is not None:
            found[cls.option] = value
    return found


def validate_level(boost_config):
    """Makes every stage a configuration describes once, so bad values fail at construction."""
    _ensure_builtin()
    for cls in [e.cls for e in _ENTRIES] + _DEFAULTS:
        cls.from_level(boost_config, validate=True)


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
            "nan_guard": step.stage("nan_guard") is not None,
            "stages": {s.option: serialize(s) for s in step.stages if not is_default(s)}}


def options_from_config(config):
    """`BoostModel.compile` keyword arguments from `step_config`'s dict."""
    options = {"sens": config.get("sens", 1.0), "gradient_split_groups": config.get("gradient_split_groups"),
               "nan_guard": config.get("nan_guard", False)}
    for option, stage in config.get("stages", {}).items():
        if option != "nan_guard":
            options[option] = deserialize(stage)
    return options


# ---------------------------------------------------------------- builtin
_BUILTIN_LOADED = False
_DEFAULTS = []  # the default stages of single hooks, made when no other stage owns the hook


# keras_boost's own stages, in their order: (module under keras_boost.stages, class, options that
# replace it). A built-in feature is its stage file plus one line here.
BUILTIN = (
    ("loss_scale", "LossScale", ()),
    ("nan_guard", "NanGuard", ("loss_scale",)),
    ("accumulation", "GradientAccumulation", ()),
    ("freeze", "FreezeStage", ()),
    ("centralization", "GradientCentralization", ()),
    ("clipping", "GradientClipping", ()),
    ("fused_update", "FusedUpdate", ()),
    ("fused_batchnorm", "FusedBatchNorm", ()),
    ("conv_matmul", "ConvMatmul", ()),
    ("adasum", "AdaSum", ()),
    ("compression", "GradientCompression", ()),
    ("hierarchical", "HierarchicalAllreduce", ()),
    ("ema", "ExponentialMovingAverage", ()),
    ("swa", "StochasticWeightAveraging", ()),
)
# the default stages of single hooks, made when no other stage owns the hook
BUILTIN_DEFAULTS = (("average", "Average"), ("optimizer_update", "OptimizerUpdate"))
# the model rewrites a level may run when a BoostModel is made, in their order (core/rewrite.py)
BUILTIN_REWRITES = (("less_bn", "LessBNRewrite"),)
_REWRITES = []


def _stage_class(module, name):
    return getattr(importlib.import_module(f"keras_boost.stages.{module}"), name)


def _ensure_builtin():
    """Registers keras_boost's own stages, in their order, on first use."""
    global _BUILTIN_LOADED
    if _BUILTIN_LOADED:
        return
    _BUILTIN_LOADED = True
    builtin = [_Entry(_stage_class(module, name), unless) for module, name, unless in BUILTIN]
    _ENTRIES[:0] = [e for e in builtin if e.cls.option not in [x.cls.option for x in _ENTRIES]]
    _DEFAULTS[:] = [_stage_class(module, name) for module, name in BUILTIN_DEFAULTS]
    _REWRITES[:0] = [_stage_class(module, name)() for module, name in BUILTIN_REWRITES]


def rewrites():
    """The model rewrites (`core.rewrite.ModelRewrite`), in the order a BoostModel runs them."""
    _ensure_builtin()
    return list(_REWRITES)


def register_rewrite(rewrite):
    """Adds a `ModelRewrite` instance after the others; returns it."""
    from keras_boost.core.rewrite import ModelRewrite

    if not isinstance(rewrite, ModelRewrite):
        raise TypeError(f"`rewrite` must be a ModelRewrite instance, got {rewrite!r} ({type(rewrite).__name__}).")
    _REWRITES.append(rewrite)
    return rewrite


def check_stage(stage):
    """`stage`, when it is a Stage (a `stages=[...]` entry); TypeError otherwise."""
    if not isinstance(stage, Stage):
        raise TypeError(f"`stages` must hold keras_boost Stage objects, got {stage!r} ({type(stage).__name__}).")
    return stage
