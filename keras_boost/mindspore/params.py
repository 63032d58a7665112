"""OptimizerProcess and ParameterProcess: MindSpore's optimizer and parameter-group helpers.

Keras 3 optimizers hold no parameter groups, so MindSpore's group dicts map onto
plain objects: gradient centralization becomes an optimizer wrapper
(`keras_boost.optimizers.CentralizedOptimizer`) over a set of variables, and groups of
parameters are lists of variables matched across models by `variable.path`.
"""

import copy

import keras

from keras_boost import _keras_compat, _warnings
from keras_boost.stages.centralization import GradientCentralization, gc_variables


class OptimizerProcess:
    """Makes the optimizer of a rewritten model, with gradient centralization when asked.

    MindSpore's `OptimizerProcess` rebuilds the optimizer with gradient-centralization
    parameter groups, and the optimizer centralises by itself. Here
    `add_grad_centralization(model)` records the variables MindSpore would put in its GC
    group, and `generate_new_optimizer()` returns the optimizer wrapped in
    `keras_boost.optimizers.CentralizedOptimizer` restricted to them (MindSpore's rule:
    rank >= 2 and an input-channel count that is a multiple of 16), so it centralises on
    any Keras model, `keras.Model.compile` included. Without `add_grad_centralization`
    it returns the optimizer itself.

    The user's optimizer object is kept (its learning-rate schedule, custom or not, its
    `exclude_from_weight_decay`, everything): it is returned as it is while it is not
    built. A Keras optimizer is bound to the variables it was built on, so a built one is
    replaced by a copy made from its class and `get_config()`, with a warning.

    Args:
        opt: a `keras.optimizers.Optimizer`.

    Example:

    >>> process = OptimizerProcess(keras.optimizers.SGD(0.1, momentum=0.9))
    >>> model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, name="fc")], name="net")
    >>> stage = process.add_grad_centralization(model)
    >>> [v.path for v in process.gc_variables]
    ['net/fc/kernel']
    >>> type(process.generate_new_optimizer()).__name__
    'CentralizedOptimizer'
    """

    def __init__(self, opt):
        if not isinstance(opt, keras.optimizers.Optimizer):
            raise TypeError(
                f"`opt` must be a keras.optimizers.Optimizer, got {type(opt).__name__}."
            )
        self.optimizer = opt
        self.optimizer_class = type(opt)
        self.gc_variables = []
        self.gc_added = False
        self.min_channels_multiple = 16

    @property
    def config(self):
        """The optimizer's `get_config()` (read only when a copy is needed)."""
        return self.optimizer.get_config()

    @staticmethod
    def build_params_dict(model):
        """Maps `id(variable)` to the innermost layer owning it, for every weight of `model`.

        Args:
            model: a Keras layer or model.

        Returns:
            A dict `{id(variable): layer}`.
        """
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"`model` must be a Keras layer or model, got {type(model).__name__}.")
        owners = {}
        # Outer layers come first, so the innermost owner is written last.
        for layer in _keras_compat.flatten_layers(model):
            for variable in layer.weights:
                owners[id(variable)] = layer
        return owners

    @staticmethod
    def build_gc_params_group(params_dict, parameters):
        """Splits `parameters` into the variables to centralise and the others.

        A variable is centralised when its owner selects it in `gc_variables` (conv,
        Dense and EinsumDense kernels; not biases, BN, depthwise kernels or FNHead).

        Args:
            params_dict: the dict returned by `build_params_dict`.
            parameters: non-empty list or tuple of variables, all in `params_dict`.

        Returns:
            A tuple `(centralized, others)` of lists, each in `parameters`' order.
        """
        _check_variables(parameters, "parameters")
        centralized, others = [], []
        for variable in parameters:
            owner = params_dict.get(id(variable))
            if owner is None:
                raise ValueError(
                    f"`parameters` holds {variable.path}, which no layer in `params_dict` owns."
                )
            selected = any(v is variable for v in gc_variables(owner))
            (centralized if selected else others).append(variable)
        return centralized, others

    def add_grad_centralization(self, model, min_channels_multiple=16):
        """Records the GC variables of `model` and returns the stage that centralises them.

        Args:
            model: the Keras model to be trained, with trainable variables.
            min_channels_multiple: see `GradientCentralization`. Defaults to 16.

        Returns:
            A `GradientCentralization` over `self.gc_variables`.
        """
        params_dict = self.build_params_dict(model)
        self.gc_variables, _ = self.build_gc_params_group(params_dict, model.trainable_variables)
        self.gc_added = True
        self.min_channels_multiple = min_channels_multiple
        return GradientCentralization(self.gc_variables, min_channels_multiple)

    def generate_new_optimizer(self):
        """The optimizer to train the model with.

        After `add_grad_centralization`: a `keras_boost.optimizers.CentralizedOptimizer`
        around the optimizer, centring the gradients of `gc_variables` only. Otherwise the
        optimizer. The user's object while it is not built; a copy from its config once
        it is (a built Keras optimizer cannot take new variables).
        """
        from keras_boost.optimizers import CentralizedOptimizer

        inner = self.optimizer
        if inner.built:
            _warnings.warn(f"OptimizerProcess: the optimizer {inner.name!r} is already built on other variables; "
                           "the new model gets a fresh copy made from its get_config() (state, and what the config "
                           "does not hold, are not carried over)", UserWarning)
            inner = self.optimizer_class.from_config(copy.deepcopy(self.config))
            pattern = getattr(self.optimizer, "_exclude_from_weight_decay_pattern", None)
            if pattern is not None:
                inner._exclude_from_weight_decay_pattern = pattern
        if not self.gc_added or not self.gc_variables:
            return inner
        return CentralizedOptimizer(inner, GradientCentralization(list(self.gc_variables), self.min_channels_multiple))


class ParameterProcess:
    """Allreduce fusion groups of a model's variables, and their transfer to a new model.

    MindSpore sets `param.comm_fusion` ids 1, 2, ... on slices of the parameter list;
    here the slices themselves are returned, group k being fusion id k + 1.

    Example:

    >>> inputs = keras.Input((8,))
    >>> hidden = keras.layers.Dense(4, name="hidden")(inputs)
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))
    >>> groups = ParameterProcess.assign_parameter_group(model.trainable_variables)
    >>> [[v.path for v in group] for group in groups]
    [['hidden/kernel', 'hidden/bias'], ['out/kernel', 'out/bias']]
    """

    @staticmethod
    def assign_parameter_group(parameters, split_point=None):
        """Splits `parameters` into consecutive groups at the given indices.

        Args:
            parameters: non-empty list or tuple of variables.
            split_point: an int or a list of ints, strictly increasing, each in
                `[1, len(parameters) - 1]`. Defaults to `len(parameters) // 2`, or no
                split for a single variable.

        Returns:
            A list of `len(split_point) + 1` non-empty lists of variables.
        """
        _check_variables(parameters, "parameters")
        points = _split_points(split_point, len(parameters))
        bounds = [0] + points + [len(parameters)]
        return [list(parameters[start:end]) for start, end in zip(bounds, bounds[1:])]

    @staticmethod
    def generate_group_params(parameters, origin_params):
        """Maps groups of a model's variables onto the variables of its rewritten copy.

        Variables are matched by `variable.path`. A flat `origin_params` gives one group
        holding all of `parameters`. Otherwise each group keeps, in `parameters`' order,
        the new variables whose path it held (a group may become empty, so positions
        are kept); new variables matching no group (the FN `multiplier`) form one
        extra group at the end; old variables absent from the new model (a dropped
        bias) disappear.

        Args:
            parameters: non-empty list or tuple of the new model's variables.
            origin_params: a list of the old variables, or a list of groups (lists of
                old variables).

        Returns:
            A list of lists of variables from `parameters`.
        """
        _check_variables(parameters, "parameters")
        groups = _origin_groups(origin_params)
        if groups is None:
            return [list(parameters)]
        paths = [{v.path for v in group} for group in groups]
        result = [[v for v in parameters if v.path in group] for group in paths]
        known = set().union(*paths)
        unmatched = [v for v in parameters if v.path not in known]
        return result + [unmatched] if unmatched else result


def _check_variables(parameters, name):
    if not isinstance(parameters, (list, tuple)):
        raise TypeError(
            f"`{name}` must be a list or tuple of keras.Variable, got {type(parameters).__name__}."
        )
    if not parameters:
        raise ValueError(f"`{name}` must not be empty: the optimizer got an empty parameter list.")
    wrong = [type(v).__name__ for v in parameters if not isinstance(v, keras.Variable)]
    if wrong:
        raise TypeError(f"`{name}` must hold only keras.Variable, got {', '.join(sorted(set(wrong)))}.")


def _split_points(split_point, count):
    if split_point is None:
        return [count // 2] if count > 1 else []
    points = [split_point] if isinstance(split_point, int) else split_point
    if (
        isinstance(split_point, bool)
        or not isinstance(points, (list, tuple))
        or any(isinstance(p, bool) or not isinstance(p, int) for p in points)
    ):
        raise TypeError(f"`split_point` must be an int or a list of ints, got {split_point!r}.")
    points = list(points)
    if any(not 0 < p < count for p in points) or points != sorted(set(points)):
        raise ValueError(
            f"`split_point` must be strictly increasing indices in [1, {count - 1}] for "
            f"{count} parameters, got {split_point!r}."
        )
    return points


def _origin_groups(origin_params):
    """None for a flat variable list, else the list of groups, after validation."""
    if not isinstance(origin_params, (list, tuple)):
        raise TypeError(
            "`origin_params` must be a list of variables or a list of lists of variables, "
            f"got {type(origin_params).__name__}."
        )
    if not origin_params:
        raise ValueError("`origin_params` must not be empty.")
    if all(isinstance(v, keras.Variable) for v in origin_params):
        return None
    for group in origin_params:
        if not isinstance(group, (list, tuple)) or not all(
            isinstance(v, keras.Variable) for v in group
        ):
            raise TypeError(
                "`origin_params` must be a list of variables or a list of lists of "
                f"variables, got an element of type {type(group).__name__}."
            )
    return list(origin_params)
