"""Gradient centralization as a Keras 3 optimizer wrapper.

`GradientCentralization(optimizer)` wraps any Keras optimizer, as
`keras.optimizers.LossScaleOptimizer` does: every gradient it receives is centred
(`g - mean(g, axes=all but the last)`, Yong et al., ECCV 2020) before the inner optimizer
applies it. Keras 3 calls `apply` (through `apply_gradients` or `fit`), never the
`get_gradients` that the keras-io example overrides, so this works where that example's
optimizer silently does nothing.
"""

import keras

from keras_boost.core.adapter import OptimizerAdapter
from keras_boost.stages.centralization import centralize, centralizes

_RULES = ("all", "mindspore")


@keras.saving.register_keras_serializable(package="keras_boost")
class GradientCentralization(OptimizerAdapter):
    """An optimizer that centralizes the gradients, then lets `inner_optimizer` apply them.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` that applies the update.
        rule: which gradients are centred.
            "all" (default, the keras-io recipe): every gradient of rank 2 or more.
            "mindspore": MindSpore's rule, gradients of rank 2 or more whose input-channel
            size (`shape[-2]`, Keras' `(..., in, out)` layout) is a multiple of 16.
        name: the optimizer's name.
        variables: None (default: every gradient the rule selects), or a list or tuple of
            Keras variables (or their `path`s): only their gradients are centred, still
            subject to `rule`. `OptimizerProcess` passes the variables MindSpore would
            put in its `grad_centralization` group.

    The learning rate, iterations and slots are the inner optimizer's. The wrapper has
    no state of its own; saving and `.keras` files round-trip it.

    Example:
        >>> optimizer = keras_boost.optimizers.GradientCentralization(keras.optimizers.Adam(1e-3))
        >>> model = keras.Model(inputs, outputs)
        >>> model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    """

    # A boost level's gradient centralization is not added on top of it (it centralises
    # already); the step keeps it as the optimizer (`registry.unwrap_optimizer`).
    boost_option = "gradient_centralization"
    unwraps_into_step = False

    def __init__(self, inner_optimizer, rule="all", name=None, variables=None, **kwargs):
        if rule not in _RULES:
            raise ValueError(f"rule must be one of {list(_RULES)}, got {rule!r}")
        if variables is not None and (not isinstance(variables, (list, tuple)) or not (
                all(isinstance(v, keras.Variable) for v in variables) or all(isinstance(v, str) for v in variables))):
            raise TypeError(f"variables must be None or a list or tuple of keras.Variable (or of variable paths), "
                            f"got {variables!r} of type {type(variables).__name__}")
        super().__init__(inner_optimizer, name=name, **kwargs)
        self.rule = rule
        self.min_channels_multiple = 16 if rule == "mindspore" else 1
        if variables is None:
            self._selected_ids = self._selected_paths = None
        else:
            self._selected_ids = {id(v) for v in variables if not isinstance(v, str)}
            self._selected_paths = {v if isinstance(v, str) else v.path for v in variables}

    def applies_to(self, variable):
        """Whether the gradient of `variable` gets centred."""
        if self._selected_paths is not None and id(variable) not in self._selected_ids and not _path_selected(
                variable.path, self._selected_paths):
            return False
        return centralizes(variable.shape, self.min_channels_multiple)

    def centralize(self, grads, trainable_variables):
        """The gradients with the selected ones centred (None passes through)."""
        out = []
        for g, v in zip(grads, trainable_variables):
            out.append(centralize(g, shape=v.shape) if g is not None and self.applies_to(v) else g)
        return out

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        self.inner_optimizer.apply(self.centralize(grads, trainable_variables), trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        own = len(self._variables)
        grads = self.centralize(list(grads), list(trainable_variables))
        new_trainable, new_inner = self.inner_optimizer.stateless_apply(
            optimizer_variables[own:], grads, trainable_variables)
        return new_trainable, list(optimizer_variables[:own]) + list(new_inner)

    def get_config(self):
        config = {"name": self.name, "rule": self.rule,
                  "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}
        if self._selected_paths is not None:
            config["variables"] = sorted(self._selected_paths)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def _path_selected(path, selected):
    """Whether `path` is one of `selected`, allowing for a model-name prefix added or dropped on load."""
    return path in selected or any(path.endswith("/" + p) or p.endswith("/" + path) for p in selected)
