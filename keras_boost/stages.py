"""Turns the boost options of `BoostModel.compile` into stages of the boost step."""

from keras_boost.accumulation import GradientAccumulation


def accumulation_option(value):
    """None, an int number of micro-batches per update, or a `GradientAccumulation`."""
    if value is None or isinstance(value, GradientAccumulation):
        return None if value is not None and value.max_accumulation_step == 1 else value
    stage = GradientAccumulation(value)
    return None if stage.max_accumulation_step == 1 else stage


def freeze_option(value):
    """None, a `GradientFreeze`, a `FreezeOpt` or a ready `FreezeSchedule`."""
    from keras_boost.freeze import FreezeSchedule

    if value is None or isinstance(value, FreezeSchedule):
        return value
    return FreezeSchedule(value)


def centralization_option(value, model):
    """None/False, True (the default variable selection of `gc_variables`) or a `GradientCentralization`."""
    if value is None or value is False:
        return None
    from keras_boost.centralization import GradientCentralization, gc_variables

    if value is True:
        return GradientCentralization(gc_variables(model))
    if isinstance(value, GradientCentralization):
        return value
    raise TypeError(f"gradient_centralization must be a bool or a GradientCentralization, got {value!r}")


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
