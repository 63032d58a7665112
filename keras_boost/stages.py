"""Turns the boost options of `BoostModel.compile` into stages of the boost step."""

from keras_boost.accumulation import GradientAccumulation


def accumulation_option(value):
    """None, an int number of micro-batches per update, or a `GradientAccumulation` (1 means off)."""
    if value is None:
        return None
    stage = value if isinstance(value, GradientAccumulation) else GradientAccumulation(value)
    return None if stage.max_accumulation_step == 1 else stage


def freeze_option(value):
    """None, a `GradientFreeze`, a `FreezeOpt` or a ready `FreezeSchedule`."""
    from keras_boost.freeze import FreezeSchedule

    if value is None or isinstance(value, FreezeSchedule):
        return value
    return FreezeSchedule(value)


def centralization_option(value, model):
    """None/False, True or "mindspore", "all", or a `GradientCentralization`.

    True and "mindspore" are MindSpore's rule (the level's default): conv/dense kernels of
    `gc_variables` whose input channels are a multiple of 16. "all" is the keras-io
    recipe: every trainable variable of rank 2 or more.
    """
    if value is None or value is False:
        return None
    from keras_boost.centralization import GradientCentralization, gc_variables

    if value is True or (isinstance(value, str) and value == "mindspore"):
        return GradientCentralization(gc_variables(model))
    if isinstance(value, str) and value == "all":
        return GradientCentralization([v for v in model.trainable_variables if len(v.shape) >= 2], 1)
    if isinstance(value, GradientCentralization):
        return value
    raise TypeError(f"gradient_centralization must be a bool, 'mindspore', 'all' or a GradientCentralization, "
                    f"got {value!r}")


def adasum_option(value):
    """None/False, True, or an `AdaSum` stage."""
    if value is None or value is False:
        return None
    from keras_boost.adasum import AdaSum

    if value is True:
        return AdaSum()
    if isinstance(value, AdaSum):
        return value
    raise TypeError(f"adasum must be a bool or an AdaSum, got {value!r}")


def _by_path(model, paths):
    variables = {v.path: v for v in model.trainable_variables}
    missing = [p for p in paths if p not in variables]
    if missing:
        raise ValueError(f"the saved boost configuration names variables this model does not have: {missing[:3]}")
    return [variables[p] for p in paths]


def step_config(step):
    """The boost options of a compiled step as a JSON-serialisable dict (for `.keras` files)."""
    from keras_boost.freeze import GradientFreeze

    config = {"sens": step.sens, "gradient_split_groups": step.split_points or None, "nan_guard": step.nan_guard}
    if step.loss_scale is not None:
        config["loss_scale"] = {"class_name": type(step.loss_scale).__name__, "config": step.loss_scale.get_config()}
    if step.accumulation is not None:
        config["gradient_accumulation"] = step.accumulation.max_accumulation_step
    if step.freeze is not None:
        source = step.freeze.source
        if isinstance(source, GradientFreeze):
            config["gradient_freeze"] = {"GradientFreeze": source.get_config()}
        else:
            config["gradient_freeze"] = {"FreezeOpt": {
                "groups": [[v.path for v in branch.variables] for branch in step.freeze.plan.branches],
                "strategy": None if source.strategy is None else [int(i) for i in source.strategy]}}
    if step.centralization is not None:
        config["gradient_centralization"] = {"variables": [v.path for v in step.centralization.variables],
                                             "min_channels_multiple": step.centralization.min_channels_multiple}
    if step.adasum is not None:
        config["adasum"] = step.adasum.get_config()
    return config


def options_from_config(config, model, optimizer):
    """`BoostModel.compile` keyword arguments from `step_config`'s dict."""
    from keras_boost.adasum import AdaSum
    from keras_boost.centralization import GradientCentralization
    from keras_boost.freeze import FreezeOpt, GradientFreeze
    from keras_boost.loss_scale import DynamicLossScale, FixedLossScale

    options = {"sens": config.get("sens", 1.0), "gradient_split_groups": config.get("gradient_split_groups"),
               "nan_guard": config.get("nan_guard", True)}
    if "loss_scale" in config:
        classes = {"DynamicLossScale": DynamicLossScale, "FixedLossScale": FixedLossScale}
        options["loss_scale"] = classes[config["loss_scale"]["class_name"]](**config["loss_scale"]["config"])
    if "gradient_accumulation" in config:
        options["gradient_accumulation"] = config["gradient_accumulation"]
    freeze = config.get("gradient_freeze")
    if freeze is not None and "GradientFreeze" in freeze:
        options["gradient_freeze"] = GradientFreeze(**freeze["GradientFreeze"])
    elif freeze is not None:
        groups = [_by_path(model, paths) for paths in freeze["FreezeOpt"]["groups"]]
        options["gradient_freeze"] = FreezeOpt(optimizer, groups, freeze["FreezeOpt"]["strategy"])
    if "gradient_centralization" in config:
        gc = config["gradient_centralization"]
        options["gradient_centralization"] = GradientCentralization(_by_path(model, gc["variables"]),
                                                                    gc["min_channels_multiple"])
    if "adasum" in config:
        options["adasum"] = AdaSum(**config["adasum"])
    return options
